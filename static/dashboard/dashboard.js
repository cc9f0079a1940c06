// Draws the dashboard charts from the figures embedded in the page
// (R-DASH-1), with the vendored Chart.js. Colours follow the admin theme.
(function () {
  "use strict";
  var PALETTE = ["#2563eb", "#15803d", "#b91c1c", "#b45309", "#7c3aed", "#0891b2", "#9d174d", "#6b7280"];
  var STATUS = {
    pending: "#60a5fa", running: "#2563eb", cancel_requested: "#7c3aed", completed: "#15803d",
    failed: "#b91c1c", cancelled: "#b45309", interrupted: "#d97706"
  };

  function cssVar(name, fallback) {
    var value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
    return value || fallback;
  }

  function draw(id, config) {
    var canvas = document.getElementById(id);
    if (!canvas) return;
    config.options = Object.assign({ responsive: true, maintainAspectRatio: false, animation: false }, config.options || {});
    canvas.parentElement.style.height = "300px";
    new window.Chart(canvas, config);
    canvas.dataset.drawn = "1";
  }

  function start() {
    var node = document.getElementById("yx-dashboard-data");
    if (!node || !window.Chart || !window.yxPalette) return;
    var data = JSON.parse(node.textContent);
    window.Chart.defaults.color = cssVar("--body-fg", "#333");
    window.Chart.defaults.borderColor = cssVar("--hairline-color", "#ddd");

    var statuses = Object.keys(data.overview.runs_by_status);
    draw("chart-runs-status", {
      type: "bar",
      data: { labels: statuses, datasets: [{ label: "runs", data: statuses.map(function (s) { return data.overview.runs_by_status[s]; }),
        backgroundColor: statuses.map(function (s) { return STATUS[s] || "#6b7280"; }) }] },
      options: { plugins: { legend: { display: false } }, scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } }
    });

    var days = data.timeseries.map(function (d) { return d.day; });
    draw("chart-activity", {
      type: "line",
      data: { labels: days, datasets: ["conversations", "messages", "runs"].map(function (key, i) {
        return { label: key, data: data.timeseries.map(function (d) { return d[key]; }), borderColor: PALETTE[i], backgroundColor: PALETTE[i], tension: 0.2 };
      }) },
      options: { scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } }
    });

    var tokenRows = data.models.tokens_by_model_day;
    var costRows = data.costs.by_model_day;
    var models = Array.from(new Set(tokenRows.map(function (r) { return r.model; })));
    // One colour per model, the same in the token and the cost chart, and
    // distinct however many models there are (palette.js, issue 37).
    var modelColour = window.yxPalette.byName(
      tokenRows.map(function (r) { return r.model; }).concat(costRows.map(function (r) { return r.model; })));
    draw("chart-tokens", {
      type: "bar",
      data: { labels: days, datasets: models.map(function (model) {
        return { label: model, backgroundColor: modelColour[model], data: days.map(function (day) {
          return tokenRows.filter(function (r) { return r.model === model && r.day === day; })
            .reduce(function (sum, r) { return sum + r.total_tokens; }, 0);
        }) };
      }) },
      options: { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true } } }
    });

    // Cost (R-COST-2): USD arrive as decimal strings.
    var costModels = Array.from(new Set(costRows.map(function (r) { return r.model; })));
    draw("chart-cost", {
      type: "bar",
      data: { labels: days, datasets: costModels.map(function (model) {
        return { label: model, backgroundColor: modelColour[model], data: days.map(function (day) {
          return costRows.filter(function (r) { return r.model === model && r.day === day; })
            .reduce(function (sum, r) { return sum + parseFloat(r.total_usd || "0"); }, 0);
        }) };
      }) },
      options: { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true } } }
    });

    var costUsers = data.costs.by_user;
    draw("chart-cost-users", {
      type: "bar",
      data: { labels: costUsers.map(function (r) { return r.key; }), datasets: [
        { label: "USD", data: costUsers.map(function (r) { return parseFloat(r.total_usd || "0"); }), backgroundColor: PALETTE[4] }
      ] },
      options: { indexAxis: "y", plugins: { legend: { display: false } }, scales: { x: { beginAtZero: true } } }
    });

    var latency = data.models.latency;
    draw("chart-latency", {
      type: "bar",
      data: { labels: latency.map(function (r) { return r.model; }), datasets: [
        { label: "p50 ms", data: latency.map(function (r) { return r.p50_ms; }), backgroundColor: PALETTE[0] },
        { label: "p95 ms", data: latency.map(function (r) { return r.p95_ms; }), backgroundColor: PALETTE[3] }
      ] },
      options: { scales: { y: { beginAtZero: true } } }
    });

    var tools = data.tools.by_tool;
    draw("chart-tools", {
      type: "bar",
      data: { labels: tools.map(function (t) { return t.tool_name; }), datasets: [
        { label: "successes", data: tools.map(function (t) { return t.successes; }), backgroundColor: STATUS.completed },
        { label: "failures", data: tools.map(function (t) { return t.failures; }), backgroundColor: STATUS.failed },
        { label: "other (running, interrupted, abandoned)", data: tools.map(function (t) { return t.executions - t.successes - t.failures; }), backgroundColor: "#6b7280" }
      ] },
      options: { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true, ticks: { precision: 0 } } } }
    });

    var toolDays = data.tools.by_day;
    draw("chart-tools-day", {
      type: "line",
      data: { labels: toolDays.map(function (d) { return d.day; }), datasets: [
        { label: "executions", data: toolDays.map(function (d) { return d.executions; }), borderColor: PALETTE[0], backgroundColor: PALETTE[0] },
        { label: "successes", data: toolDays.map(function (d) { return d.successes; }), borderColor: STATUS.completed, backgroundColor: STATUS.completed },
        { label: "failures", data: toolDays.map(function (d) { return d.failures; }), borderColor: STATUS.failed, backgroundColor: STATUS.failed }
      ] },
      options: { scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } }
    });

    draw("chart-feedback", {
      type: "doughnut",
      data: { labels: ["likes", "dislikes"], datasets: [{ data: [data.feedback.likes, data.feedback.dislikes], backgroundColor: [STATUS.completed, STATUS.failed] }] }
    });
    document.getElementById("yx-dashboard").dataset.chartsDrawn = String(document.querySelectorAll("canvas[data-drawn='1']").length);
  }

  document.addEventListener("DOMContentLoaded", start);
})();
