// Series colours of the dashboard charts (R-DASH-1, issue 37): one colour
// per model, the same in every chart. The first 20 are hand-picked to be
// told apart (Kelly's and Tableau's distinct colours, readable on light and
// dark backgrounds); past those, hues step by the golden angle, so no two
// series of a chart share a colour however many models there are.
(function () {
  "use strict";
  var COLOURS = [
    "#2563eb", "#ea580c", "#15803d", "#dc2626", "#7c3aed",
    "#0891b2", "#ca8a04", "#db2777", "#65a30d", "#4f46e5",
    "#0d9488", "#9333ea", "#b45309", "#be123c", "#0284c7",
    "#16a34a", "#a21caf", "#854d0e", "#475569", "#f59e0b"
  ];

  function colour(i) {
    if (i < COLOURS.length) return COLOURS[i];
    var hue = Math.round(((i - COLOURS.length) * 137.508 + 17) % 360);
    var light = 38 + ((i - COLOURS.length) % 3) * 10;
    return "hsl(" + hue + ", 70%, " + light + "%)";
  }

  // Colours keyed by name: sorted names get colours in order, so a model
  // keeps its colour across charts (tokens and cost).
  function byName(names) {
    var sorted = Array.from(new Set(names)).sort();
    var map = {};
    sorted.forEach(function (name, i) { map[name] = colour(i); });
    return map;
  }

  window.yxPalette = { colours: COLOURS, colour: colour, byName: byName };
})();
