// Line charts on uPlot, which `npm ci --prefix service/dashboard` installs and the service serves
// from node_modules. Without it the page still works: each chart says how to install it.

import { bytes, duration, h, num } from "./format.js";

const INSTALL_HINT = "npm ci --prefix service/dashboard";
let uPlotPromise = null;

function loadUPlot() {
  if (!uPlotPromise) {
    uPlotPromise = import("/ui/vendor/uPlot.esm.js")
      .then((module) => {
        document.head.append(h("link", { rel: "stylesheet", href: "/ui/vendor/uPlot.min.css" }));
        return module.default;
      })
      .catch(() => null);
  }
  return uPlotPromise;
}

export const PALETTE = ["#2456d6", "#d9480f", "#2b8a3e", "#7048e8", "#c2255c", "#0c8599"];

const AXIS = { stroke: "#5c6370", grid: { stroke: "#eceef2", width: 1 }, ticks: { stroke: "#d5d8de", width: 1 },
  font: "11px system-ui, sans-serif", labelFont: "600 11px system-ui, sans-serif" };

// Steps are whole numbers: never put a tick at step 2.5.
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];

// Byte axes tick at round binary sizes (256 MiB, 1 GiB), not at 381 MiB.
const BYTE_INCRS = [0, 1, 2, 3, 4].flatMap((k) => [1, 2, 4, 8, 16, 32, 64, 128, 256, 512].map((m) => m * 1024 ** k));

/** A time-axis tick: "0.5s", "42s", then "3m 20s", "1h 05m". */
function clockTick(seconds) {
  return Math.abs(seconds) < 60 ? `${num(seconds, 3)}s` : duration(seconds);
}

const UNIT_FORMAT = {
  bytes: (v) => bytes(v),
  "GB/s": (v) => `${num(v, 3)}`,
  s: (v) => `${num(v, 3)}`,
  ms: (v) => `${num(v, 3)}`,
  "": (v) => num(v, 3),
};

/**
 * A chart card: `title`, x axis `xLabel` (`xUnit` "duration" for seconds), y axis `yLabel` in `unit`,
 * one line per entry of `series` ({label, color}). With `logToggle`, a checkbox switches the y axis to a
 * log scale (a loss that falls by orders of magnitude). Returns {element, setData(xs, ...ys)}.
 */
export function lineChart({ title, xLabel, xUnit = "", yLabel, unit = "", series, testId, logToggle = false }) {
  const body = h("div", { class: "chart-body" });
  const log = logToggle ? h("input", { type: "checkbox", "data-log": testId }) : null;
  const element = h("section", { class: "card chart", "data-chart": testId, "data-points": "0" },
    h("div", { class: "card-head" }, h("h3", { class: "card-title" }, title),
      log ? h("label", { class: "small muted toggle" }, log, " log scale") : null),
    body);
  let uPlot = null;
  let plot = null;
  let data = [[], ...series.map(() => [])];

  function build() {
    plot?.destroy();
    const logY = Boolean(log?.checked);
    const fmt = UNIT_FORMAT[unit] || UNIT_FORMAT[""];
    // A log axis cannot show zero or less: those points are left out while it is on.
    const shown = logY ? [data[0], ...data.slice(1).map((ys) => ys.map((v) => (v > 0 ? v : null)))] : data;
    plot = new uPlot({
      width: Math.max(240, body.clientWidth || 480), height: 220,
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false }, y: logY ? { distr: 3 } : {} },
      axes: [
        { ...AXIS, label: xLabel, size: 42, ...(xLabel === "step" ? { incrs: STEP_INCRS } : {}),
          ...(xUnit === "duration" ? { values: (u, splits) => splits.map(clockTick) } : {}) },
        { ...AXIS, label: unit && unit !== "bytes" ? `${yLabel} (${unit})` : yLabel, size: unit === "bytes" ? 72 : 60,
          values: (u, splits) => splits.map(fmt), ...(unit === "bytes" && !logY ? { incrs: BYTE_INCRS } : {}) },
      ],
      series: [
        { label: xLabel, value: (u, v) => (v == null ? "—" : xUnit === "duration" ? clockTick(v) : num(v, 5)) },
        ...series.map((s, i) => ({
          label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: 1.75,
          points: { size: 4 }, spanGaps: true,
          value: (u, v) => (v == null ? "—" : unit === "bytes" ? bytes(v) : `${num(v, 4)}${unit ? ` ${unit}` : ""}`),
        })),
      ],
    }, shown, body);
  }

  loadUPlot().then((loaded) => {
    if (!loaded) {
      element.dataset.missing = "true";
      log?.closest("label")?.remove();
      body.replaceChildren(h("div", { class: "chart-missing" },
        "Charts are not installed. Run ", h("code", {}, INSTALL_HINT), " and reload."));
      return;
    }
    uPlot = loaded;
    build();
    log?.addEventListener("change", build);
    new ResizeObserver(() => {
      const w = body.clientWidth;
      if (w && plot && Math.abs(w - plot.width) > 2) plot.setSize({ width: w, height: 220 });
    }).observe(body);
  });

  return {
    element,
    setData(xs, ...ys) {
      data = [xs, ...ys];
      const points = ys.length ? Math.max(...ys.map((y) => y.filter((v) => v !== null && v !== undefined).length)) : 0;
      element.dataset.points = String(points);
      element.classList.toggle("chart-empty", !xs.length);
      if (!plot) return;
      if (log?.checked) build();  // the log view filters the data, so it is rebuilt
      else plot.setData(data);
    },
  };
}
