// Subagent calls fold under the tool row that spawned them (R-SUB-1), and
// live refresh of a run's audit timeline while the run is not terminal
// (R-ADM-1): re-fetch the timeline fragment, keep expanded rows expanded,
// and bring the run's status, usage, duration and finish time in the page
// header up to date from the fragment's hidden copies (data-yx-live).
// A payload longer than the page's preview (issue 37) loads whole from the
// admin's payload view when its row is expanded (a.yx-full beside the
// preview), and again from memory after a live refresh. A thread's
// timeline loads the rows of a collapsed run when it is opened.
(function () {
  "use strict";
  var PERIOD_MS = 2000;
  // Ids of tool rows whose subagent calls are hidden (R-SUB-1); kept
  // across the live refresh.
  var collapsed = {};

  function applyCollapsed(root) {
    root.querySelectorAll("tr[data-yx-ancestors]").forEach(function (tr) {
      var ancestors = (tr.dataset.yxAncestors || "").split(" ");
      tr.hidden = ancestors.some(function (id) { return id && collapsed[id]; });
    });
    root.querySelectorAll("button[data-yx-toggle]").forEach(function (button) {
      var shut = !!collapsed[button.dataset.yxToggle];
      button.setAttribute("aria-expanded", shut ? "false" : "true");
      button.textContent = (shut ? "▸" : "▾") + button.textContent.slice(1);
    });
  }

  // Whole payloads already fetched, by URL: a live refresh brings the
  // previews back and must not fetch them again.
  var whole = {};

  function showWhole(link, text) {
    var note = link.closest(".yx-cut");
    var pre = note && note.previousElementSibling;
    if (!pre || pre.tagName !== "PRE") return;
    pre.textContent = text;
    note.textContent = "whole text: " + text.length.toLocaleString("en-US") + " characters";
  }

  function loadWhole(details) {
    details.querySelectorAll("a.yx-full[data-yx-full]").forEach(function (link) {
      var url = link.getAttribute("href");
      if (whole[url] !== undefined) { showWhole(link, whole[url]); return; }
      if (link.dataset.yxLoading) return;
      link.dataset.yxLoading = "1";
      link.textContent = "loading the whole text…";
      fetch(url, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
        .then(function (response) { return response.ok ? response.text() : Promise.reject(response.status); })
        .then(function (text) { whole[url] = text; showWhole(link, text); })
        .catch(function () {
          delete link.dataset.yxLoading;
          link.textContent = "whole text (could not load: open it here)";
        });
    });
  }

  // A collapsed run of a thread's timeline carries no rows: opening it
  // loads the run's timeline fragment (its own waterfall axis) in place.
  function loadRunRows(group) {
    var holder = group.querySelector(".yx-run-rows[data-yx-rows-url]");
    if (!holder || holder.dataset.yxLoading) return;
    holder.dataset.yxLoading = "1";
    fetch(holder.dataset.yxRowsUrl, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (response) { return response.ok ? response.text() : Promise.reject(response.status); })
      .then(function (html) {
        var box = document.createElement("div");
        box.innerHTML = html;
        var rows = box.querySelector(".yx-scroll");
        if (!rows) return Promise.reject("no rows");
        var truncated = box.querySelector(".yx-truncated");
        if (truncated) holder.parentNode.insertBefore(truncated, holder);
        holder.replaceWith(rows);
        var timeline = document.getElementById("yx-timeline");
        if (timeline) applyCollapsed(timeline);
      })
      .catch(function () {
        delete holder.dataset.yxLoading;
        holder.firstChild.nodeValue = "The run's calls could not be loaded (close and open to retry); they are on ";
      });
  }

  // "toggle" does not bubble: listen in the capture phase.
  document.addEventListener("toggle", function (event) {
    var details = event.target;
    if (!details.matches || !details.open) return;
    if (details.matches("details.yx-details")) loadWhole(details);
    else if (details.matches("details.yx-run-group")) loadRunRows(details);
  }, true);

  document.addEventListener("click", function (event) {
    var button = event.target.closest && event.target.closest("button[data-yx-toggle]");
    if (!button) return;
    var id = button.dataset.yxToggle;
    if (collapsed[id]) delete collapsed[id]; else collapsed[id] = true;
    var timeline = document.getElementById("yx-timeline");
    if (timeline) applyCollapsed(timeline);
  });

  // The page title, heading and breadcrumbs name the run with its status
  // ("run … (running)"): once the status changes, say the new one there too.
  function retitle(before, after) {
    if (!before || !after || before === after) return;
    document.title = document.title.split(before).join(after);
    document.querySelectorAll("#content h1, #content h2, .breadcrumbs").forEach(function (element) {
      var walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
      for (var node = walker.nextNode(); node; node = walker.nextNode()) {
        if (node.nodeValue.indexOf(before) !== -1) node.nodeValue = node.nodeValue.split(before).join(after);
      }
    });
  }

  function refresh() {
    var current = document.getElementById("yx-timeline");
    if (!current || current.dataset.live !== "1") return;
    fetch(current.dataset.refreshUrl, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html) {
          var open = {};
          current.querySelectorAll("details[open]").forEach(function (d) {
            open[d.closest("tr").dataset.id] = true;
          });
          var holder = document.createElement("div");
          holder.innerHTML = html;
          var next = holder.querySelector("#yx-timeline");
          if (next) {
            next.querySelectorAll("tr.yx-detail[data-id]").forEach(function (tr) {
              if (open[tr.dataset.id]) tr.querySelector("details").open = true;
            });
            retitle(current.dataset.runTitle, next.dataset.runTitle);
            applyCollapsed(next);
            current.replaceWith(next);
            next.querySelectorAll("details.yx-details[open]").forEach(loadWhole);
            next.querySelectorAll(".yx-run-live [data-yx-live]").forEach(function (fresh) {
              document.querySelectorAll("[data-yx-live='" + fresh.dataset.yxLive + "']").forEach(function (shown) {
                if (!shown.closest(".yx-run-live")) shown.innerHTML = fresh.innerHTML;
              });
            });
          }
        }
        window.setTimeout(refresh, PERIOD_MS);
      })
      .catch(function () { window.setTimeout(refresh, PERIOD_MS * 2); });
  }

  document.addEventListener("DOMContentLoaded", function () { window.setTimeout(refresh, PERIOD_MS); });
})();
