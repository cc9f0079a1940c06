// Subagent calls fold under the tool row that spawned them (R-SUB-1), and
// live refresh of a run's audit timeline while the run is not terminal
// (R-ADM-1): re-fetch the timeline fragment, keep expanded rows expanded,
// and bring the run's status, usage, duration and finish time in the page
// header up to date from the fragment's hidden copies (data-yx-live).
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
