/* The chat page (R-UI-1): threads, a new thread, history, send, the live
   answer over Server-Sent Events, tool calls as they run, cancel.

   Everything goes through the JSON API (docs/api.md) with the session
   cookie; unsafe methods carry the CSRF token the template renders. The
   Content Security Policy allows no inline script: this file is the page's
   only script and its data comes from the json_script block #yc-config.
   Text from the API is always set with textContent, never as HTML. */
(function () {
  "use strict";

  const app = document.getElementById("yc-app");
  const config = JSON.parse(document.getElementById("yc-config").textContent);
  const $ = (id) => document.getElementById(id);
  const el = {
    model: $("yc-model"),
    newThread: $("yc-new-thread"),
    threadList: $("yc-thread-list"),
    threadsEmpty: $("yc-threads-empty"),
    title: $("yc-thread-title"),
    messages: $("yc-messages"),
    live: $("yc-live"),
    liveText: $("yc-live-text"),
    status: $("yc-status"),
    send: $("yc-send"),
    input: $("yc-input"),
    sendButton: $("yc-send-button"),
    cancel: $("yc-cancel"),
  };
  const ACTIVE = new Set(["pending", "running", "cancel_requested"]);
  const TITLE_WORDS = 8;

  // `unsent`: a turn whose submission got no answer (network error); sending
  // the same text again reuses its request_id, so a turn that did reach the
  // server is answered with its run instead of starting twice.
  const state = { threads: [], threadId: null, runId: null, source: null, unsent: null };

  // --- API -----------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, body) {
      const error = (body && body.error) || {};
      super(error.message || `HTTP ${status}`);
      this.status = status;
      this.code = error.code || "";
    }
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (method !== "GET") headers["X-CSRFToken"] = app.dataset.csrfToken;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch("/api" + path, {
      method,
      headers,
      credentials: "same-origin",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const data = response.status === 204 ? null : await response.json().catch(() => null);
    if (response.status === 401) {
      // The session ended (signed out elsewhere, expired): sign in again.
      location.assign(`${app.dataset.loginUrl}?next=${encodeURIComponent(location.pathname + location.hash)}`);
    }
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }

  // --- small helpers -------------------------------------------------------

  function node(tag, className, text) {
    const n = document.createElement(tag);
    if (className) n.className = className;
    if (text !== undefined && text !== null) n.textContent = text;
    return n;
  }

  function setStatus(text, isError) {
    el.status.textContent = text || "";
    el.status.classList.toggle("yc-error", !!isError);
  }

  function firstWords(text) {
    const words = text.trim().split(/\s+/);
    const head = words.slice(0, TITLE_WORDS).join(" ");
    return (words.length > TITLE_WORDS ? head + "…" : head).slice(0, 200);
  }

  // crypto.randomUUID exists only in secure contexts (HTTPS, localhost);
  // getRandomValues everywhere.
  function newRequestId() {
    if (crypto.randomUUID) return crypto.randomUUID();
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function threadLabel(thread) {
    return thread.title || "Untitled thread";
  }

  function when(iso) {
    const d = new Date(iso);
    return isNaN(d) ? "" : d.toLocaleString();
  }

  // --- threads -------------------------------------------------------------

  function fillModels() {
    for (const name of config.models) {
      const option = node("option", null, name);
      option.value = name;
      option.selected = name === config.default_model;
      el.model.append(option);
    }
  }

  function renderThreads() {
    el.threadList.replaceChildren();
    for (const thread of state.threads) {
      const item = node("li");
      const button = node("button", "yc-thread", threadLabel(thread));
      button.type = "button";
      button.dataset.threadId = thread.thread_id;
      button.title = threadLabel(thread);
      button.setAttribute("aria-current", String(thread.thread_id === state.threadId));
      button.append(node("small", null, `${thread.model} · ${when(thread.created_at)}`));
      button.addEventListener("click", () => selectThread(thread.thread_id));
      item.append(button);
      el.threadList.append(item);
    }
    el.threadsEmpty.hidden = state.threads.length > 0;
  }

  async function loadThreads() {
    const page = await api("GET", "/threads?archived=false&limit=100");
    state.threads = page.items;
    renderThreads();
  }

  async function createThread(event) {
    event.preventDefault();
    setStatus("");
    try {
      const thread = await api("POST", "/threads", { agent_id: config.agent_id, model: el.model.value });
      state.threads.unshift(thread);
      await selectThread(thread.thread_id);
      el.input.focus();
    } catch (error) {
      setStatus(`Could not create the thread: ${error.message}`, true);
    }
  }

  function currentThread() {
    return state.threads.find((t) => t.thread_id === state.threadId) || null;
  }

  async function selectThread(threadId) {
    stopFollowing();
    state.threadId = threadId;
    if (location.hash !== "#" + threadId) history.replaceState(null, "", "#" + threadId);
    renderThreads();
    const thread = currentThread();
    el.title.textContent = thread ? threadLabel(thread) : "Thread";
    el.messages.replaceChildren();
    setStatus("Loading…");
    setComposer(true);
    try {
      await loadHistory();
      setStatus("");
      // A run of this thread may still be going (the page was reloaded
      // while it ran): follow it.
      const runs = await api("GET", `/threads/${threadId}/runs?limit=1`);
      if (threadId !== state.threadId) return; // another thread was chosen meanwhile
      const last = runs.items[0];
      if (last && ACTIVE.has(last.status)) follow(last.run_id);
      else if (last && last.status === "interrupted") showFinished({ status: "interrupted" }, last.run_id);
    } catch (error) {
      setStatus(`Could not load the thread: ${error.message}`, true);
    }
  }

  // --- history -------------------------------------------------------------

  function toolItem(tool) {
    const item = node("li", "yc-tool");
    item.dataset.toolCallId = tool.id;
    const details = node("details");
    const summary = node("summary");
    summary.append(
      node("span", "yc-badge", "tool"),
      node("span", "yc-tool-name", tool.name),
      " · ",
      node("span", "yc-tool-status", tool.status),
    );
    details.append(summary, node("pre", null, tool.content));
    item.append(details);
    return item;
  }

  function renderItem(item) {
    const isUser = item.kind === "user";
    const li = node("li", "yc-msg " + (isUser ? "yc-user-msg" : "yc-assistant"));
    li.dataset.kind = item.kind;
    li.append(node("span", "yc-role", isUser ? "You" : "Assistant"));
    // The model's words come before the tool calls it asked for.
    if (item.content) li.append(node("div", "yc-text", item.content));
    if (item.kind === "tool_carrier") {
      const tools = node("ul", "yc-tools");
      const ran = new Map(item.tool_executions.map((t) => [t.id, t]));
      for (const call of item.tool_calls || []) {
        const done = ran.get(call.id);
        tools.append(toolItem(done || { id: call.id, name: call.name, status: "not run", content: "" }));
      }
      li.append(tools);
    }
    if (item.payload_note) li.append(node("div", "yc-role", item.payload_note));
    return li;
  }

  async function loadHistory() {
    const threadId = state.threadId;
    const page = await api("GET", `/threads/${threadId}/history?limit=200`);
    if (threadId !== state.threadId) return; // another thread was chosen meanwhile
    el.messages.replaceChildren(...page.items.map(renderItem));
    el.messages.lastElementChild?.scrollIntoView({ block: "end" });
  }

  // --- sending and following a run ------------------------------------------

  function setComposer(enabled) {
    el.input.disabled = !enabled;
    el.sendButton.disabled = !enabled;
  }

  async function sendMessage(event) {
    event.preventDefault();
    const text = el.input.value.trim();
    if (!text || !state.threadId) return;
    const threadId = state.threadId;
    setComposer(false);
    setStatus("Sending…");
    const unsent = state.unsent;
    const requestId =
      unsent && unsent.threadId === threadId && unsent.text === text ? unsent.requestId : newRequestId();
    state.unsent = { threadId, text, requestId };
    try {
      const run = await api("POST", `/threads/${threadId}/runs`, { request_id: requestId, input: { text } });
      state.unsent = null;
      el.input.value = "";
      el.messages.append(renderItem({ kind: "user", content: text, tool_executions: [] }));
      const thread = currentThread();
      if (thread && !thread.title) nameThread(thread, text);
      follow(run.run_id);
    } catch (error) {
      // An answer from the server settles the request: only a lost one is retried with its id.
      if (error instanceof ApiError) state.unsent = null;
      setComposer(true);
      setStatus(`Could not send: ${error.message}`, true);
    }
  }

  // A thread without a title is named after the first words of its first
  // message, so the thread list can tell threads apart.
  async function nameThread(thread, text) {
    try {
      const named = await api("PATCH", `/threads/${thread.thread_id}`, { title: firstWords(text) });
      Object.assign(thread, named);
      renderThreads();
      if (thread.thread_id === state.threadId) el.title.textContent = threadLabel(thread);
    } catch (error) {
      // The list keeps "Untitled thread": nothing else depends on the title.
    }
  }

  function stopFollowing() {
    if (state.source) state.source.close();
    state.source = null;
    state.runId = null;
    el.live.hidden = true;
    el.cancel.hidden = true;
    app.dataset.runStatus = "";
  }

  function liveSegment(operationId) {
    let segment = el.liveText.querySelector(`[data-operation-id="${CSS.escape(operationId)}"]`);
    if (!segment) {
      segment = node("div", "yc-segment");
      segment.dataset.operationId = operationId;
      el.liveText.append(segment);
    }
    return segment;
  }

  // Model text and tool calls show in the order the stream brings them.
  function liveTool(toolCallId, name) {
    let item = el.liveText.querySelector(`[data-tool-call-id="${CSS.escape(toolCallId)}"]`);
    if (!item) {
      item = node("div", "yc-tool");
      item.dataset.toolCallId = toolCallId;
      item.append(
        node("span", "yc-badge", "tool"),
        node("span", "yc-tool-name", name || "tool"),
        " · ",
        node("span", "yc-tool-status", "running"),
      );
      el.liveText.append(item);
    }
    return item;
  }

  function count(key) {
    app.dataset[key] = String(Number(app.dataset[key] || 0) + 1);
  }

  const STATUS_TEXT = {
    pending: "Waiting for a worker…",
    running: "The assistant is answering…",
    cancel_requested: "Cancelling…",
    completed: "",
    cancelled: "The run was cancelled.",
    failed: "The run failed.",
    interrupted: "The run waits for an approval (approvals come in a later version of this page).",
  };

  function showRunStatus(status) {
    app.dataset.runStatus = status;
    setStatus(STATUS_TEXT[status] ?? status, status === "failed");
    el.cancel.hidden = !ACTIVE.has(status);
    el.cancel.disabled = status === "cancel_requested";
  }

  function follow(runId) {
    stopFollowing();
    state.runId = runId;
    el.liveText.replaceChildren();
    el.live.hidden = false;
    setComposer(false);
    showRunStatus("pending");
    // EventSource sends the session cookie (same origin) and, when it
    // reconnects after a dropped connection, the last event id it received
    // as Last-Event-ID: the server resumes with no gap and no repeat.
    const source = new EventSource(`/api/runs/${runId}/events`);
    state.source = source;
    const on = (type, handle) =>
      source.addEventListener(type, (event) => {
        if (state.source !== source) return;
        handle(event.data ? JSON.parse(event.data) : {}, event);
      });

    on("run.status", (data) => showRunStatus(data.status));
    on("model.started", (data) => liveSegment(data.operation_id));
    on("model.delta", (data) => {
      liveSegment(data.operation_id).append(data.text || "");
      count("deltas");
      el.live.scrollIntoView({ block: "end" });
    });
    on("tool.started", (data) => {
      liveTool(data.tool_call_id, data.tool_name);
      count("toolEvents");
    });
    on("tool.finished", (data) => {
      liveTool(data.tool_call_id).querySelector(".yc-tool-status").textContent = data.status || "completed";
    });
    on("tool.error", (data) => {
      liveTool(data.tool_call_id).querySelector(".yc-tool-status").textContent = "error";
    });
    on("gap", (data) => {
      // Events the stream no longer holds: its state from PostgreSQL stands
      // in for them (the history shows the rest once the run ends).
      if (data.state && data.state.status) showRunStatus(data.state.status);
    });
    on("run.finished", (data) => finish(source, data, runId));
    source.addEventListener("error", (event) => {
      if (state.source !== source) return;
      if (event.data) {
        // The server's own `error` event: the run is gone (deleted).
        finish(source, { status: "failed", error_type: JSON.parse(event.data).error }, runId);
      } else if (source.readyState === EventSource.CLOSED) {
        // The browser gave up reconnecting: read the run's state instead.
        recoverFromClosedStream(source, runId);
      }
      // Otherwise the browser reconnects by itself, with Last-Event-ID.
    });
  }

  async function recoverFromClosedStream(source, runId) {
    try {
      const run = await api("GET", `/runs/${runId}`);
      if (ACTIVE.has(run.status)) {
        if (state.source === source) follow(runId);
      } else {
        finish(source, run, runId);
      }
    } catch (error) {
      if (state.source === source) setStatus(`Lost the run's live events: ${error.message}`, true);
    }
  }

  async function finish(source, data, runId) {
    if (state.source !== source) return;
    source.close();
    state.source = null;
    state.runId = null;
    el.cancel.hidden = true;
    try {
      await loadHistory();
    } catch (error) {
      setStatus(`Could not reload the history: ${error.message}`, true);
      return;
    }
    el.live.hidden = true;
    showFinished(data, runId);
  }

  // An interrupted run holds its thread until it is resumed or cancelled:
  // until this page answers approvals, it offers Cancel to free the thread.
  function showFinished(data, runId) {
    showRunStatus(data.status);
    const interrupted = data.status === "interrupted";
    state.runId = interrupted ? runId : null;
    el.cancel.hidden = !interrupted;
    el.cancel.disabled = false;
    if (data.status === "failed" && data.error_type) setStatus(`The run failed (${data.error_type}).`, true);
    setComposer(!interrupted);
  }

  async function cancelRun() {
    const runId = state.runId;
    if (!runId) return;
    el.cancel.disabled = true;
    try {
      const run = await api("POST", `/runs/${runId}/cancel`);
      if (state.runId !== runId) return;
      if (ACTIVE.has(run.status)) showRunStatus(run.status);
      else if (!state.source) {
        // No live stream to tell the end (an interrupted run, cancelled at once).
        await loadHistory();
        showFinished(run, runId);
      }
    } catch (error) {
      // 409: the run ended meanwhile; its run.finished event tells how.
      if (error.status !== 409) setStatus(`Could not cancel: ${error.message}`, true);
    }
  }

  // --- start ---------------------------------------------------------------

  el.newThread.addEventListener("submit", createThread);
  el.send.addEventListener("submit", sendMessage);
  el.cancel.addEventListener("click", cancelRun);
  el.input.addEventListener("keydown", (event) => {
    // Enter sends, Shift+Enter starts a new line.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      el.send.requestSubmit();
    }
  });

  fillModels();
  loadThreads()
    .then(() => {
      const wanted = location.hash.slice(1);
      if (wanted && state.threads.some((t) => t.thread_id === wanted)) selectThread(wanted);
    })
    .catch((error) => setStatus(`Could not load your threads: ${error.message}`, true));
})();
