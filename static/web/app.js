/* Progressive enhancement only: every page works without this file. */
(function () {
  "use strict";

  // Copy buttons: <button data-copy="#input-id">.
  document.addEventListener("click", function (ev) {
    var btn = ev.target.closest("[data-copy]");
    if (!btn) return;
    var input = document.querySelector(btn.getAttribute("data-copy"));
    if (!input) return;
    var done = function () {
      btn.textContent = "Copied";
      var status = document.getElementById(btn.getAttribute("aria-describedby") || "");
      if (status) status.textContent = "Copied to the clipboard.";
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(input.value).then(done, function () {
        input.select(); document.execCommand("copy"); done();
      });
    } else {
      input.select(); document.execCommand("copy"); done();
    }
  });

  // New job form: show the sections that apply to the chosen method.
  var method = document.getElementById("id_method");
  if (method) {
    var apply = function () {
      document.querySelectorAll("[data-methods]").forEach(function (el) {
        var ok = el.getAttribute("data-methods").split(" ").indexOf(method.value) >= 0;
        el.hidden = !ok;
      });
    };
    method.addEventListener("change", apply);
    apply();
  }

  // Live charts of a job's metrics (uPlot), polled until the job is final.
  var box = document.getElementById("charts");
  if (!box || !window.uPlot) return;
  var url = box.getAttribute("data-url");
  var interval = 1000 * parseFloat(box.getAttribute("data-interval") || "2");
  var charts = {};
  window.openTinkerCharts = charts;
  var palette = ["#1f5fbf", "#b8420f", "#1d6b35", "#6b4a8a", "#8a5200", "#0f6f78", "#a8231b", "#374151"];

  function width(el) { return Math.max(240, el.clientWidth - 16); }

  // Tick labels that stay readable for tiny (1e-5) and huge values alike.
  function fmt(v) {
    if (v === 0) return "0";
    var a = Math.abs(v);
    if (a >= 1e5 || a < 1e-3) return v.toExponential(1);
    return String(+v.toPrecision(4));
  }

  // A metric that has converged (1.0, 1.0000000000000002, ...) spans less than float precision;
  // uPlot's own range then asks for billions of ticks and stops drawing. Pad such spans.
  function yRange(u, min, max) {
    if (min == null || max == null) return [0, 1];
    var mag = Math.max(Math.abs(min), Math.abs(max), 1e-12);
    var span = max - min;
    if (span < mag * 1e-6) return [min - mag * 1e-3, max + mag * 1e-3];
    return [min - span * 0.05, max + span * 0.05];
  }

  function ensure(name, i) {
    if (charts[name]) return charts[name];
    var wrap = document.createElement("figure");
    wrap.className = "chart";
    wrap.setAttribute("data-metric", name);
    var title = document.createElement("h3");
    title.textContent = name;
    wrap.appendChild(title);
    box.appendChild(wrap);
    var color = palette[i % palette.length];
    wrap.setAttribute("data-color", color);
    var opts = {
      width: width(wrap), height: 200,
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [
        { label: "step", values: function (u, ticks) { return ticks.map(fmt); } },
        { size: 64, values: function (u, ticks) { return ticks.map(fmt); } },
      ],
      legend: { show: true },
      series: [{ label: "step" }, { label: name, stroke: color, width: 2, points: { show: true, size: 5, fill: color } }],
    };
    var u = new uPlot(opts, [[], []], wrap);
    u.root.querySelector("canvas").setAttribute("aria-label", "chart of " + name + " against step");
    u.root.querySelector("canvas").setAttribute("role", "img");
    charts[name] = { plot: u, wrap: wrap, color: color };
    return charts[name];
  }

  function update(payload) {
    var empty = document.getElementById("charts-empty");
    var names = payload.order && payload.order.length ? payload.order : Object.keys(payload.series);
    var added = names.some(function (name) { return !charts[name]; });
    names.forEach(function (name, i) {
      var points = payload.series[name] || [];
      var c = ensure(name, i);
      c.plot.setData([points.map(function (p) { return p[0]; }), points.map(function (p) { return p[1]; })]);
      c.wrap.setAttribute("data-points", String(points.length));
    });
    if (added) resize();  // a new chart changes the grid: fit every chart to its cell
    if (empty) empty.hidden = names.length > 0;
    box.setAttribute("data-state", payload.state);
  }

  function poll() {
    fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (payload) {
        update(payload);
        if (!payload.final) setTimeout(poll, interval);
        else box.setAttribute("data-done", "true");
      })
      .catch(function () { setTimeout(poll, interval * 3); });
  }

  function resize() {
    Object.keys(charts).forEach(function (k) {
      var c = charts[k]; c.plot.setSize({ width: width(c.wrap), height: 200 });
    });
  }
  window.addEventListener("resize", resize);
  poll();
})();
