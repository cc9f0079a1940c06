/* The chat page (R-UI-1): threads, a new thread, history (older pages on
   demand), send, the live answer over Server-Sent Events, tool calls as
   they run, cancel, approvals (approve, edit, reject), feedback on final
   answers, the cost of each turn, and renaming, archiving and deleting a thread.

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
    moreThreads: $("yc-more-threads"),
    threadsEmpty: $("yc-threads-empty"),
    showArchived: $("yc-show-archived"),
    title: $("yc-thread-title"),
    archivedBadge: $("yc-thread-archived"),
    actions: $("yc-thread-actions"),
    renameButton: $("yc-rename-button"),
    archiveButton: $("yc-archive-button"),
    deleteButton: $("yc-delete-button"),
    rename: $("yc-rename"),
    renameInput: $("yc-rename-input"),
    renameCancel: $("yc-rename-cancel"),
    renameError: $("yc-rename-error"),
    deleteDialog: $("yc-delete-dialog"),
    deleteText: $("yc-delete-text"),
    deleteError: $("yc-delete-error"),
    deleteKeep: $("yc-delete-keep"),
    deleteConfirm: $("yc-delete-confirm"),
    deleteCancelRun: $("yc-delete-cancel-run"),
    older: $("yc-older"),
    messages: $("yc-messages"),
    live: $("yc-live"),
    liveText: $("yc-live-text"),
    status: $("yc-status"),
    send: $("yc-send"),
    input: $("yc-input"),
    sendButton: $("yc-send-button"),
    cancel: $("yc-cancel"),
    approval: $("yc-approval"),
  };
  const ACTIVE = new Set(["pending", "running", "cancel_requested"]);
  // The pause before reading a run whose stream the browser gave up on,
  // doubled after each failed attempt up to the most (ms).
  const RETRY_FIRST_MS = 1000;
  const RETRY_MOST_MS = 15000;
  // Threads per page of the list.
  const THREAD_PAGE = 100;
  // Items per history page: the endpoint's most (HISTORY_PAGE_MAX).
  const HISTORY_PAGE = 200;
  const NO_THREAD_TITLE = el.title.textContent;

  // `unsent`: a turn whose submission got no answer (network error); sending
  // the same text again reuses its request_id, so a turn that did reach the
  // server is answered with its run instead of starting twice.
  // `unresumed`: the same for a resume whose POST got no answer.
  // `thread`: the open thread (GET /threads/{id}'s body), kept apart from
  // `threads`, the list, which leaves archived threads out by default.
  // `threadsOffset`: how many of the list's threads the server has given,
  // the `offset` of the next page ("Show more threads"); `threadsMore`:
  // whether it holds more; `threadsLoad`: counts list loads, so a page read
  // for a list since reloaded (the archived box ticked) is dropped.
  // `historyBefore`: the history's `next_before` for the page older than
  // the ones shown, null when the oldest is shown.
  const state = {
    threads: [],
    threadsOffset: 0,
    threadsMore: false,
    threadsLoad: 0,
    threadId: null,
    thread: null,
    historyBefore: null,
    runId: null,
    source: null,
    retry: null,
    unsent: null,
    unresumed: null,
  };

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

  // The models meant for a person to try (audit.catalogue.chat_models),
  // each scenario's description as its option's tooltip.
  function fillModels() {
    for (const model of config.models) {
      const option = node("option", null, model.name);
      option.value = model.name;
      if (model.description) option.title = model.description;
      option.selected = model.name === config.default_model;
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
      button.dataset.archived = String(thread.archived);
      const facts = `${thread.model} · ${when(thread.created_at)}`;
      button.append(node("small", null, thread.archived ? `archived · ${facts}` : facts));
      button.addEventListener("click", () => selectThread(thread.thread_id));
      item.append(button);
      el.threadList.append(item);
    }
    el.moreThreads.hidden = !state.threadsMore;
    el.threadsEmpty.hidden = state.threads.length > 0;
    el.threadsEmpty.textContent = el.showArchived.checked
      ? "No threads yet."
      : "No threads to show (archived threads are hidden).";
  }

  // Archived threads are left out of the list unless "Show archived
  // threads" is ticked; then the list holds both, archived ones marked.
  function threadsPage(offset) {
    const filter = el.showArchived.checked ? "" : "&archived=false";
    return api("GET", `/threads?limit=${THREAD_PAGE}&offset=${offset}${filter}`);
  }

  // Pages the server gives by offset, newest first: a thread created or
  // deleted elsewhere meanwhile shifts them by one, so a thread already
  // listed is not listed twice.
  function addThreads(threads) {
    const listed = new Set(state.threads.map((t) => t.thread_id));
    state.threads.push(...threads.filter((t) => !listed.has(t.thread_id)));
  }

  // The first page of the list; with `keep`, as many pages as it takes to
  // list as many threads as before (the list reloaded after an archiving
  // keeps what "Show more threads" added).
  async function loadThreads(keep = false) {
    const load = ++state.threadsLoad;
    const wanted = keep ? state.threadsOffset : 0;
    const threads = [];
    let offset = 0;
    let count = 0;
    do {
      const page = await threadsPage(offset);
      if (load !== state.threadsLoad) return;
      threads.push(...page.items);
      offset += page.items.length;
      count = page.count;
      if (!page.items.length) break;
    } while (offset < Math.min(wanted, count));
    state.threads = [];
    addThreads(threads);
    state.threadsOffset = offset;
    state.threadsMore = offset < count;
    renderThreads();
  }

  // "Show more threads": the next page, below; focus goes to its first thread.
  async function loadMoreThreads() {
    const load = state.threadsLoad;
    const shown = state.threads.length;
    el.moreThreads.disabled = true;
    try {
      const page = await threadsPage(state.threadsOffset);
      if (load !== state.threadsLoad) return;
      addThreads(page.items);
      state.threadsOffset += page.items.length;
      state.threadsMore = page.items.length > 0 && state.threadsOffset < page.count;
      renderThreads();
      el.threadList.children[shown]?.querySelector("button")?.focus();
    } catch (error) {
      setStatus(`Could not load more threads: ${error.message}`, true);
    } finally {
      el.moreThreads.disabled = false;
    }
  }

  async function reloadThreads() {
    try {
      await loadThreads();
    } catch (error) {
      setStatus(`Could not load your threads: ${error.message}`, true);
    }
  }

  async function createThread(event) {
    event.preventDefault();
    setStatus("");
    try {
      const thread = await api("POST", "/threads", { agent_id: config.agent_id, model: el.model.value });
      state.threads.unshift(thread);
      state.threadsOffset += 1; // the server lists it first: later pages shift by one
      await selectThread(thread.thread_id);
      el.input.focus();
    } catch (error) {
      setStatus(`Could not create the thread: ${error.message}`, true);
    }
  }

  function currentThread() {
    return state.thread;
  }

  // The open thread's title, its archived mark and its actions.
  function showThreadHead() {
    const thread = state.thread;
    el.title.textContent = thread ? threadLabel(thread) : state.threadId ? "Thread" : NO_THREAD_TITLE;
    el.archivedBadge.hidden = !(thread && thread.archived);
    el.actions.hidden = !thread || !el.rename.hidden;
    el.archiveButton.textContent = thread && thread.archived ? "Unarchive" : "Archive";
  }

  // A thread as the API now gives it: the list's copy and the open one.
  function updateThread(thread) {
    const listed = state.threads.find((t) => t.thread_id === thread.thread_id);
    if (listed) Object.assign(listed, thread);
    if (state.threadId === thread.thread_id) state.thread = listed || thread;
    renderThreads();
    showThreadHead();
  }

  async function selectThread(threadId) {
    stopFollowing();
    closeRename();
    state.threadId = threadId;
    // An archived thread is not in the list unless it shows them: read it.
    state.thread = state.threads.find((t) => t.thread_id === threadId) || null;
    if (location.hash !== "#" + threadId) history.replaceState(null, "", "#" + threadId);
    renderThreads();
    showThreadHead();
    el.messages.replaceChildren();
    setOlder(null);
    setStatus("Loading…");
    // The composer opens once the history is shown: an answer sent before
    // would be wiped by the history load that lands after it.
    setComposer(false);
    try {
      if (!state.thread) {
        const thread = await api("GET", `/threads/${threadId}`);
        if (threadId !== state.threadId) return;
        state.thread = thread;
        showThreadHead();
      }
      await loadHistory();
      if (threadId !== state.threadId) return;
      setStatus("");
      setComposer(true);
      // A run of this thread may still be going (the page was reloaded
      // while it ran): follow it.
      const runs = await api("GET", `/threads/${threadId}/runs?limit=1`);
      if (threadId !== state.threadId) return; // another thread was chosen meanwhile
      const last = runs.items[0];
      if (last && ACTIVE.has(last.status)) follow(last.run_id);
      else if (last && last.status === "interrupted") {
        showFinished(last, last.run_id);
        showApproval(last);
      }
    } catch (error) {
      if (threadId !== state.threadId) return;
      if (error.status === 404) {
        forgetThread(threadId);
        setStatus("That thread does not exist any more.", true);
      } else {
        setStatus(`Could not load the thread: ${error.message}`, true);
      }
    }
  }

  // The thread is gone (deleted here or elsewhere): out of the list, and
  // the page shows no thread if it was the open one.
  function forgetThread(threadId) {
    const listed = state.threads.length;
    state.threads = state.threads.filter((t) => t.thread_id !== threadId);
    // Later pages shift back by one.
    if (state.threads.length < listed) state.threadsOffset = Math.max(0, state.threadsOffset - 1);
    if (state.threadId === threadId) {
      stopFollowing();
      closeRename();
      state.threadId = null;
      state.thread = null;
      history.replaceState(null, "", location.pathname + location.search);
      el.messages.replaceChildren();
      setOlder(null);
      setComposer(false);
    }
    renderThreads();
    showThreadHead();
  }

  // --- rename, archive, delete (R-API-1) -------------------------------------

  function openRename() {
    if (!state.thread) return;
    el.renameInput.value = state.thread.title;
    el.renameError.textContent = "";
    el.rename.hidden = false;
    el.title.hidden = true;
    showThreadHead();
    el.renameInput.focus();
    el.renameInput.select();
  }

  // `refocus`: the user closed it; focus goes back to Rename.
  function closeRename(refocus = false) {
    const wasOpen = !el.rename.hidden;
    el.rename.hidden = true;
    el.title.hidden = false;
    showThreadHead();
    if (refocus && wasOpen && state.thread) el.renameButton.focus();
  }

  async function saveRename(event) {
    event.preventDefault();
    const thread = state.thread;
    const title = el.renameInput.value.trim();
    if (!thread) return;
    if (!title) {
      el.renameError.textContent = "The title cannot be blank.";
      el.renameInput.focus();
      return;
    }
    el.rename.querySelectorAll("button, input").forEach((c) => (c.disabled = true));
    el.renameError.textContent = "";
    try {
      updateThread(await api("PATCH", `/threads/${thread.thread_id}`, { title }));
      if (state.threadId === thread.thread_id) closeRename(true);
      setStatus("Thread renamed.");
    } catch (error) {
      el.renameError.textContent = `Could not rename the thread: ${error.message}`;
    } finally {
      el.rename.querySelectorAll("button, input").forEach((c) => (c.disabled = false));
    }
  }

  async function toggleArchived() {
    const thread = state.thread;
    if (!thread) return;
    const archived = !thread.archived;
    el.archiveButton.disabled = true;
    try {
      updateThread(await api("PATCH", `/threads/${thread.thread_id}`, { archived }));
      // The list changes: an archived thread leaves it (unless it shows
      // them), a restored one comes back in its place.
      await loadThreads(true);
      if (!archived) setStatus("Thread unarchived: it is back in the list.");
      else if (el.showArchived.checked) setStatus("Thread archived.");
      else setStatus("Thread archived: the list hides it (Show archived threads lists it).");
    } catch (error) {
      setStatus(`Could not ${archived ? "archive" : "unarchive"} the thread: ${error.message}`, true);
    } finally {
      el.archiveButton.disabled = false;
    }
  }

  function openDelete() {
    if (!state.thread) return;
    el.deleteText.textContent = `“${threadLabel(state.thread)}” and its messages are erased. This cannot be undone.`;
    el.deleteError.textContent = "";
    el.deleteConfirm.hidden = false;
    el.deleteCancelRun.hidden = true;
    el.deleteDialog.showModal();
    el.deleteKeep.focus();
  }

  // `cancel`: cancel the thread's pending or running runs first (the
  // server refuses the deletion with 409 run_active otherwise).
  async function deleteThread(cancel) {
    const threadId = state.threadId;
    if (!threadId) return;
    const buttons = el.deleteDialog.querySelectorAll("button");
    buttons.forEach((b) => (b.disabled = true));
    el.deleteError.textContent = "";
    // The run about to be cancelled and deleted is no longer followed: its
    // last events would only tell of a thread that is gone.
    if (cancel) stopFollowing();
    try {
      const deletion = await api("DELETE", `/threads/${threadId}${cancel ? "?cancel=true" : ""}`);
      el.deleteDialog.close();
      forgetThread(threadId);
      setStatus(deletion.erased ? "Thread deleted." : "Thread deleted; its messages are erased in a moment.");
      $("yc-new-button").focus();
    } catch (error) {
      if (error.code === "run_active") {
        el.deleteText.textContent =
          "A run of this thread is still going. Cancel it and delete the thread, or keep the thread?";
        el.deleteConfirm.hidden = true;
        el.deleteCancelRun.hidden = false;
      } else if (error.status === 404) {
        el.deleteDialog.close();
        forgetThread(threadId);
        setStatus("The thread was already deleted.");
      } else {
        el.deleteError.textContent = `Could not delete the thread: ${error.message}`;
      }
      // Not deleted: follow the thread's run again, as the page left it.
      if (cancel && state.threadId === threadId) selectThread(threadId);
    } finally {
      buttons.forEach((b) => (b.disabled = false));
      if (!el.deleteCancelRun.hidden && el.deleteDialog.open) el.deleteCancelRun.focus();
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
    if (item.id !== undefined) li.dataset.messageId = String(item.id);
    if (item.turn_id) li.dataset.turnId = item.turn_id;
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
    // Feedback takes a final answer only (docs/api.md, Feedback).
    if (item.kind === "answer" && item.id !== undefined) li.append(feedbackBar(item.id, item.feedback));
    return li;
  }

  // --- feedback --------------------------------------------------------------

  // `feedback`: the history item's (`{rating, reason}` when the thread's
  // owner rated the answer, else null), so a rating shows after a reload.
  function feedbackBar(messageId, feedback) {
    const bar = node("div", "yc-feedback");
    bar.setAttribute("role", "group");
    bar.setAttribute("aria-label", "Rate this answer");
    for (const [rating, label] of [
      ["like", "Like"],
      ["dislike", "Dislike"],
    ]) {
      const button = node("button", "yc-rate", label);
      button.type = "button";
      button.dataset.rating = rating;
      button.addEventListener("click", () => rate(bar, messageId, rating));
      bar.append(button);
    }
    bar.append(node("span", "yc-feedback-note"));
    showRating(bar, (feedback && feedback.rating) || "");
    return bar;
  }

  function showRating(bar, rating) {
    bar.dataset.rating = rating;
    for (const button of bar.querySelectorAll("button")) {
      button.setAttribute("aria-pressed", String(button.dataset.rating === rating));
    }
  }

  async function rate(bar, messageId, rating) {
    const buttons = bar.querySelectorAll("button");
    const note = bar.querySelector(".yc-feedback-note");
    buttons.forEach((b) => (b.disabled = true));
    note.textContent = "";
    note.classList.remove("yc-error");
    try {
      const feedback = await api("POST", `/messages/${messageId}/feedback`, { rating });
      showRating(bar, feedback.rating);
      note.textContent = "Thanks for the feedback.";
    } catch (error) {
      note.textContent = `Could not save the rating: ${error.message}`;
      note.classList.add("yc-error");
    } finally {
      buttons.forEach((b) => (b.disabled = false));
    }
  }

  // --- cost per turn ---------------------------------------------------------

  const RUN_PAGES = 10; // at most 1000 runs read back for one history page

  // The turns' runs (resume runs included), newest first, until every
  // wanted turn is seen and the page has gone past them (a turn's runs are
  // consecutive, but may straddle two pages).
  async function runsByTurn(threadId, turnIds) {
    const wanted = new Set(turnIds);
    const byTurn = new Map();
    let before = null;
    for (let page = 0; page < RUN_PAGES && wanted.size; page++) {
      const query = before ? `&before=${encodeURIComponent(before)}` : "";
      const data = await api("GET", `/threads/${threadId}/runs?limit=100${query}`);
      for (const run of data.items) {
        if (!byTurn.has(run.turn_id)) byTurn.set(run.turn_id, []);
        byTurn.get(run.turn_id).push(run);
      }
      const oldest = data.items[data.items.length - 1];
      if (!data.has_more || !oldest) break;
      for (const turnId of byTurn.keys()) if (turnId !== oldest.turn_id) wanted.delete(turnId);
      before = data.next_before;
    }
    return byTurn;
  }

  function usdText(usd) {
    if (usd > 0 && usd < 0.000001) return "< $0.000001";
    const text = usd.toFixed(6).replace(/0+$/, ""); // "0.000123", "1.5", "2."
    const decimals = text.length - text.indexOf(".") - 1;
    return "$" + text + "0".repeat(Math.max(0, 2 - decimals));
  }

  // The cost of a turn: the sum of its runs' costs. A run's `total_usd` is
  // null when no call has a known cost; calls of unknown cost are never
  // counted as zero. Tokens likewise (docs/api.md, Costs): a run's `usage`
  // counts the model calls cut off before the provider reported usage in
  // `unknown_calls`, with zero tokens for them; `usage` is null for a run
  // with no total. A turn none of whose tokens are known says "tokens
  // unknown", never "0 tokens"; one with some says how many calls it lacks.
  function turnCost(runs) {
    let usd = 0;
    let known = false;
    let unknownCalls = 0;
    let input = 0;
    let output = 0;
    let counted = false;
    let unknownUsage = 0;
    for (const run of runs) {
      if (run.cost.total_usd !== null) {
        usd += Number(run.cost.total_usd);
        known = true;
      }
      unknownCalls += run.cost.unknown_cost_calls || 0;
      if (run.usage) {
        input += run.usage.input_tokens || 0;
        output += run.usage.output_tokens || 0;
        unknownUsage += run.usage.unknown_calls || 0;
        counted = true;
      }
    }
    const calls = (n) => `${n} call${n > 1 ? "s" : ""}`;
    let text = known ? `Turn cost ${usdText(usd)}` : "Turn cost unknown";
    if (known && unknownCalls) text += ` + ${calls(unknownCalls)} of unknown cost`;
    if (!counted || (unknownUsage && input + output === 0)) {
      text += " · tokens unknown";
    } else {
      text += ` · ${(input + output).toLocaleString()} tokens (${input.toLocaleString()} in, ${output.toLocaleString()} out)`;
      if (unknownUsage) text += ` + ${calls(unknownUsage)} of unknown usage`;
    }
    return { text, usd: known ? usd.toFixed(6) : "" };
  }

  // Each finished turn's cost goes under its last item: the final answer
  // when the turn has one. A turn with a run still going shows none yet.
  // `items`: only the turns of these (an older page just shown); a turn
  // that straddles two pages keeps its cost under its last item.
  // `anchor`: an element that keeps its place on screen while the lines
  // are added above it (an older page just shown).
  async function showTurnCosts(threadId, items, anchor) {
    const last = new Map();
    for (const li of el.messages.children) if (li.dataset.turnId) last.set(li.dataset.turnId, li);
    if (items) {
      const wanted = new Set(items.map((li) => li.dataset.turnId));
      for (const turnId of [...last.keys()]) if (!wanted.has(turnId)) last.delete(turnId);
    }
    if (!last.size) return;
    const byTurn = await runsByTurn(threadId, [...last.keys()]);
    if (threadId !== state.threadId) return;
    keepInView(anchor, () => {
      for (const [turnId, li] of last) {
        const runs = byTurn.get(turnId);
        if (!runs || !li.isConnected || runs.some((run) => ACTIVE.has(run.status))) continue;
        const cost = turnCost(runs);
        const line = node("div", "yc-cost", cost.text);
        line.dataset.totalUsd = cost.usd;
        line.dataset.runs = String(runs.length);
        li.querySelector(".yc-cost")?.remove();
        li.append(line);
      }
    });
  }

  // Run `change` (DOM changes above `anchor`), then scroll by as much as
  // they moved `anchor`: it stays where the user saw it. Measured around
  // every change, not some of them, or the rest shows as a jump.
  function keepInView(anchor, change) {
    const top = anchor?.isConnected ? anchor.getBoundingClientRect().top : null;
    change();
    if (top !== null && anchor.isConnected) window.scrollBy(0, anchor.getBoundingClientRect().top - top);
  }

  function setOlder(before) {
    state.historyBefore = before;
    el.older.hidden = !before;
    el.older.disabled = false;
  }

  // One page of the history, newest first; `before`: an older page's cursor.
  function historyPage(threadId, before) {
    const query = before ? `&before=${encodeURIComponent(before)}` : "";
    return api("GET", `/threads/${threadId}/history?limit=${HISTORY_PAGE}${query}`);
  }

  // The newest page of the history, and as many older pages as it takes to
  // show as many items as before: a history reloaded after a run keeps
  // what the user read back with "Show older messages", with no gap.
  async function loadHistory() {
    const threadId = state.threadId;
    const shown = el.messages.children.length;
    let items = [];
    let before = null;
    do {
      const page = await historyPage(threadId, before);
      if (threadId !== state.threadId) return; // another thread was chosen meanwhile
      items = page.items.concat(items);
      before = page.has_more ? page.next_before : null;
    } while (before && items.length < shown);
    el.messages.replaceChildren(...items.map(renderItem));
    setOlder(before);
    try {
      await showTurnCosts(threadId);
    } catch (error) {
      // The conversation stands without its costs.
      setStatus(`Could not read the costs: ${error.message}`, true);
    }
    el.messages.lastElementChild?.scrollIntoView({ block: "end" });
  }

  // "Show older messages": the page before the oldest shown, above it; the
  // messages in view stay where they are.
  async function loadOlder() {
    const threadId = state.threadId;
    const before = state.historyBefore;
    if (!threadId || !before) return;
    el.older.disabled = true;
    let page;
    try {
      page = await historyPage(threadId, before);
    } catch (error) {
      if (threadId === state.threadId) {
        el.older.disabled = false;
        setStatus(`Could not load older messages: ${error.message}`, true);
      }
      return;
    }
    // Another thread, or the history reloaded meanwhile (a run ended).
    if (threadId !== state.threadId || state.historyBefore !== before) return;
    // The first message shown stays in place: around the older page and
    // the button hidden with the last one, then around their cost lines.
    const anchor = el.messages.firstElementChild;
    const items = page.items.map(renderItem);
    keepInView(anchor, () => {
      el.messages.prepend(...items);
      setOlder(page.has_more ? page.next_before : null);
    });
    try {
      await showTurnCosts(threadId, items, anchor);
    } catch (error) {
      setStatus(`Could not read the costs: ${error.message}`, true);
    }
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
      if (thread && !thread.title) readTitle(thread.thread_id);
      follow(run.run_id);
    } catch (error) {
      // An answer from the server settles the request: only a lost one is retried with its id.
      if (error instanceof ApiError) state.unsent = null;
      setComposer(true);
      setStatus(`Could not send: ${error.message}`, true);
    }
  }

  // The server names an untitled thread after its first message's first
  // words, with the run: read the thread back so the list can tell it apart.
  async function readTitle(threadId) {
    try {
      updateThread(await api("GET", `/threads/${threadId}`));
    } catch (error) {
      // The list keeps "Untitled thread": nothing else depends on the title.
    }
  }

  function stopFollowing() {
    if (state.source) state.source.close();
    clearTimeout(state.retry);
    state.retry = null;
    state.source = null;
    state.runId = null;
    el.live.hidden = true;
    el.cancel.hidden = true;
    hideApproval();
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
    interrupted: "The run waits for your approval.",
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
    el.live.hidden = false;
    setComposer(false);
    showRunStatus("pending");
    listen(runId, RETRY_FIRST_MS);
  }

  // Opens the run's event stream. A new EventSource has no event id to
  // resume from: the server sends the run from its first event, so the
  // live answer starts over, empty, and nothing shows twice. `retryMs`:
  // the pause before the next attempt should this stream fail at once.
  function listen(runId, retryMs) {
    el.liveText.replaceChildren();
    app.dataset.deltas = "0";
    app.dataset.toolEvents = "0";
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

    source.addEventListener("open", () => {
      if (state.source !== source) return;
      retryMs = RETRY_FIRST_MS; // connected: a later loss starts the pauses again
      showRunStatus(app.dataset.runStatus || "pending"); // no more "Reconnecting…"
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
        // The browser gave up on the stream: a reconnect got an answer
        // that is no stream (a proxy's 502 while the web server restarts).
        scheduleRecovery(source, runId, retryMs);
      } else {
        // The browser reconnects by itself, with Last-Event-ID.
        setStatus("Reconnecting…");
      }
    });
  }

  // Recovers a run whose stream closed for good before its end: after
  // `delayMs`, reads the run; an ended one shows from the history (its
  // answer is there), a running one is followed by a new stream. Each
  // failed attempt doubles the pause, up to RETRY_MOST_MS. `source`, the
  // closed stream, stays the page's own meanwhile: leaving the thread
  // (stopFollowing) or following another run drops the recovery, so one
  // run never has two followers.
  function scheduleRecovery(source, runId, delayMs) {
    source.close();
    setStatus("Reconnecting…");
    clearTimeout(state.retry);
    state.retry = setTimeout(() => recover(source, runId, delayMs), delayMs);
  }

  async function recover(source, runId, delayMs) {
    if (state.source !== source) return;
    clearTimeout(state.retry);
    state.retry = null;
    const nextMs = Math.min(delayMs * 2, RETRY_MOST_MS);
    let run;
    try {
      run = await api("GET", `/runs/${runId}`);
    } catch (error) {
      if (state.source !== source) return;
      if (error.status === 404) {
        // The run is gone with its thread: show what is left of it.
        selectThread(state.threadId);
      } else if (error instanceof ApiError && error.status < 500 && error.status !== 429) {
        stopFollowing();
        setStatus(`Lost the run's live events: ${error.message}`, true);
      } else {
        scheduleRecovery(source, runId, nextMs); // unreachable or overloaded: later
      }
      return;
    }
    if (state.source !== source) return; // left, or recovered already
    if (ACTIVE.has(run.status)) listen(runId, nextMs);
    else finish(source, run, runId);
  }

  async function finish(source, data, runId) {
    if (state.source !== source) return;
    const threadId = state.threadId;
    source.close();
    clearTimeout(state.retry);
    state.retry = null;
    state.source = null;
    state.runId = null;
    el.cancel.hidden = true;
    try {
      await loadHistory();
    } catch (error) {
      // A thread deleted meanwhile has no history left to show.
      if (state.threadId === threadId) setStatus(`Could not reload the history: ${error.message}`, true);
      return;
    }
    el.live.hidden = true;
    showFinished(data, runId);
    if (data.status === "interrupted") {
      try {
        const run = await api("GET", `/runs/${runId}`);
        if (state.runId === runId) showApproval(run);
      } catch (error) {
        setStatus(`Could not read the approval: ${error.message}`, true);
      }
    }
  }

  // An interrupted run holds its thread until it is resumed or cancelled:
  // the page offers its approval (showApproval) and Cancel.
  function showFinished(data, runId) {
    showRunStatus(data.status);
    const interrupted = data.status === "interrupted";
    state.runId = interrupted ? runId : null;
    el.cancel.hidden = !interrupted;
    el.cancel.disabled = false;
    if (!interrupted) hideApproval();
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
      if (ACTIVE.has(run.status)) {
        showRunStatus(run.status);
        // Waiting to recover its stream: read it now rather than after
        // the pause, to show how the cancellation ends.
        if (state.retry) recover(state.source, runId, RETRY_FIRST_MS);
      } else if (state.source && state.source.readyState === EventSource.CLOSED) {
        // Its stream was lost and is being recovered: the end is known now.
        await finish(state.source, run, runId);
      } else if (!state.source) {
        // No live stream to tell the end (an interrupted run, cancelled at once).
        await loadHistory();
        showFinished(run, runId);
      }
    } catch (error) {
      // 409: the run ended meanwhile; its run.finished event tells how.
      if (error.status !== 409) setStatus(`Could not cancel: ${error.message}`, true);
    }
  }

  // --- approvals -------------------------------------------------------------

  const DECISION_LABEL = { approve: "Approve", edit: "Edit", reject: "Reject", retry: "Retry", skip: "Skip" };

  function hideApproval() {
    el.approval.hidden = true;
    el.approval.replaceChildren();
    delete el.approval.dataset.runId;
  }

  // `run`: the body of GET /api/runs/{id} of the thread's interrupted run.
  // Its `approval` is pending until a resume run answers it.
  function showApproval(run) {
    const approval = run.approval;
    if (!approval || approval.status !== "pending") return;
    const form = el.approval;
    form.replaceChildren();
    form.dataset.runId = run.run_id;
    const many = approval.action_requests.length > 1;
    form.append(node("h3", "yc-approval-title", many ? "Approve these actions?" : "Approve this action?"));
    approval.action_requests.forEach((request, index) => form.append(actionCard(request, index)));
    const error = node("p", "yc-error yc-approval-error");
    error.setAttribute("role", "alert");
    const submit = node("button", null, many ? "Send decisions" : "Send decision");
    submit.type = "submit";
    submit.id = "yc-approval-submit";
    const actions = node("div", "yc-actions");
    actions.append(submit);
    form.append(error, actions);
    form.hidden = false;
    form.scrollIntoView({ block: "nearest" });
  }

  // LangChain's HumanInTheLoopMiddleware describes a request it was given
  // no description for as this prefix, then "Tool: <name>" and "Args: "
  // with the arguments as a Python repr: the card shows the arguments once,
  // as JSON, and a sentence instead (the audit keeps the description).
  const DEFAULT_DESCRIPTION = "Tool execution requires approval";

  // What the card says above the arguments: a short sentence for an
  // approval, the agent's own description if it gave one; an outcome
  // unknown request's description says what happened (R-RUN-15).
  function actionSentence(request) {
    const description = (request.description || "").trim();
    const custom = description && !description.startsWith(DEFAULT_DESCRIPTION) ? description : "";
    if (request.kind === "outcome_unknown") return custom || `${request.name || "A tool"} may or may not have run.`;
    return custom || `${request.name || "This tool"} needs your approval.`;
  }

  // One action request: the tool and its arguments, and a choice among its
  // allowed decisions; Edit opens the arguments as JSON, Reject a reason.
  // Choosing, then sending, keeps one stray click from running a tool.
  function actionCard(request, index) {
    const card = node("fieldset", "yc-action");
    card.dataset.index = String(index);
    card.dataset.toolName = request.name || "";
    const legend = node("legend");
    legend.append(node("span", "yc-badge", request.kind === "outcome_unknown" ? "outcome unknown" : "approval"));
    legend.append(node("span", "yc-tool-name", request.name || "tool"));
    card.append(legend);
    card.append(node("p", "yc-action-description", actionSentence(request)));
    const args = JSON.stringify(request.args ?? {}, null, 2);
    card.append(node("pre", "yc-args", args));
    const choices = node("div", "yc-choices");
    for (const type of request.allowed_decisions) {
      const label = node("label", "yc-choice");
      const radio = document.createElement("input");
      radio.type = "radio";
      radio.name = `yc-decision-${index}`;
      radio.value = type;
      label.append(radio, " ", DECISION_LABEL[type] || type);
      choices.append(label);
    }
    card.append(choices);
    const allowed = new Set(request.allowed_decisions);
    let editBox = null;
    let rejectBox = null;
    if (allowed.has("edit")) {
      editBox = node("label", "yc-decision-detail");
      editBox.append("Arguments (JSON)");
      const textarea = node("textarea", "yc-edit-args");
      textarea.rows = Math.min(12, args.split("\n").length + 1);
      textarea.spellcheck = false;
      textarea.value = args;
      editBox.append(textarea);
      editBox.hidden = true;
      card.append(editBox);
    }
    if (allowed.has("reject")) {
      rejectBox = node("label", "yc-decision-detail");
      rejectBox.append("Reason for the assistant (optional)");
      const input = node("input", "yc-reject-message");
      input.type = "text";
      input.maxLength = 10000;
      rejectBox.append(input);
      rejectBox.hidden = true;
      card.append(rejectBox);
    }
    choices.addEventListener("change", (event) => {
      if (editBox) editBox.hidden = event.target.value !== "edit";
      if (rejectBox) rejectBox.hidden = event.target.value !== "reject";
    });
    return card;
  }

  // One decision per action request, in order (docs/api.md, Approval and
  // resume). Throws an Error with the user's mistake: nothing is sent then.
  function collectDecisions(form) {
    const decisions = [];
    for (const card of form.querySelectorAll(".yc-action")) {
      const name = card.dataset.toolName || "the action";
      const chosen = card.querySelector("input[type=radio]:checked");
      if (!chosen) throw new Error(`Choose a decision for ${name}.`);
      const type = chosen.value;
      if (type === "edit") {
        let args;
        try {
          args = JSON.parse(card.querySelector(".yc-edit-args").value);
        } catch (error) {
          throw new Error(`The arguments of ${name} are not valid JSON: ${error.message}`);
        }
        if (args === null || typeof args !== "object" || Array.isArray(args)) {
          throw new Error(`The arguments of ${name} must be a JSON object.`);
        }
        decisions.push({ type, args });
      } else if (type === "reject") {
        const message = card.querySelector(".yc-reject-message").value.trim();
        decisions.push(message ? { type, message } : { type });
      } else {
        decisions.push({ type });
      }
    }
    return decisions;
  }

  async function submitApproval(event) {
    event.preventDefault();
    const form = el.approval;
    const runId = form.dataset.runId;
    const error = form.querySelector(".yc-approval-error");
    const submit = form.querySelector("#yc-approval-submit");
    if (!runId || submit.disabled) return;
    let decisions;
    try {
      decisions = collectDecisions(form);
    } catch (mistake) {
      error.textContent = mistake.message;
      return;
    }
    error.textContent = "";
    // As for a turn: a resume whose answer was lost is sent again with its
    // request_id, so it starts one resume run, not two.
    const body = JSON.stringify(decisions);
    const unresumed = state.unresumed;
    const requestId =
      unresumed && unresumed.runId === runId && unresumed.body === body ? unresumed.requestId : newRequestId();
    state.unresumed = { runId, body, requestId };
    submit.disabled = true;
    setStatus("Sending your decision…");
    try {
      const resume = await api("POST", `/runs/${runId}/resume`, { request_id: requestId, decisions });
      state.unresumed = null;
      if (state.runId !== runId) return; // another thread was chosen meanwhile
      follow(resume.run_id);
    } catch (failure) {
      if (failure instanceof ApiError) state.unresumed = null;
      if (failure.status === 409 && state.runId === runId) {
        // Resumed or cancelled elsewhere meanwhile: show the thread as it is now.
        await selectThread(state.threadId);
        setStatus(`The approval was already answered: ${failure.message}`, true);
        return;
      }
      submit.disabled = false;
      error.textContent = `Could not send the decision: ${failure.message}`;
      setStatus(STATUS_TEXT.interrupted);
    }
  }

  // --- start ---------------------------------------------------------------

  el.newThread.addEventListener("submit", createThread);
  el.send.addEventListener("submit", sendMessage);
  el.cancel.addEventListener("click", cancelRun);
  el.older.addEventListener("click", loadOlder);
  el.moreThreads.addEventListener("click", loadMoreThreads);
  el.approval.addEventListener("submit", submitApproval);
  el.showArchived.addEventListener("change", reloadThreads);
  el.renameButton.addEventListener("click", openRename);
  el.rename.addEventListener("submit", saveRename);
  el.renameCancel.addEventListener("click", () => closeRename(true));
  el.renameInput.addEventListener("input", () => (el.renameError.textContent = ""));
  el.renameInput.addEventListener("keydown", (event) => {
    if (event.key === "Escape") {
      event.preventDefault();
      closeRename(true);
    }
  });
  el.archiveButton.addEventListener("click", toggleArchived);
  el.deleteButton.addEventListener("click", openDelete);
  el.deleteKeep.addEventListener("click", () => el.deleteDialog.close());
  el.deleteConfirm.addEventListener("click", () => deleteThread(false));
  el.deleteCancelRun.addEventListener("click", () => deleteThread(true));
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
      // The address names the open thread; an archived one is read by id.
      const wanted = location.hash.slice(1);
      if (/^[0-9a-f-]{36}$/i.test(wanted)) selectThread(wanted);
    })
    .catch((error) => setStatus(`Could not load your threads: ${error.message}`, true));
})();
