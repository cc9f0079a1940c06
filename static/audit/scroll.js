// Marks each table box that is wider than the screen (data-yx-overflows),
// so scroll.css shows its "scroll sideways" hint only where there is
// something to scroll to (issue 37). Re-checked on resize and when a page
// replaces its content (the timeline's live refresh).
(function () {
  "use strict";
  var SELECTOR = "#changelist-form .results, .yx-scroll";
  var pending = false;

  function mark() {
    pending = false;
    document.querySelectorAll(SELECTOR).forEach(function (box) {
      var overflows = box.scrollWidth > box.clientWidth + 1;
      if (overflows !== box.hasAttribute("data-yx-overflows")) {
        box.toggleAttribute("data-yx-overflows", overflows);
      }
    });
  }

  function later() {
    if (!pending) {
      pending = true;
      window.requestAnimationFrame(mark);
    }
  }

  document.addEventListener("DOMContentLoaded", function () {
    mark();
    window.addEventListener("resize", later);
    new MutationObserver(later).observe(document.body, { childList: true, subtree: true });
  });
})();
