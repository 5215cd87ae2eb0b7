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
 * A chart card: `title`, x axis `xLabel`, y axis `yLabel` in `unit`, one line per entry of `series`
 * ({label, color}). Returns {element, setData(xs, ...ys), points()}.
 */
export function lineChart({ title, xLabel, xUnit = "", yLabel, unit = "", series, testId, logY = false }) {
  const body = h("div", { class: "chart-body" });
  const element = h("section", { class: "card chart", "data-chart": testId, "data-points": "0" },
    h("h3", { class: "card-title" }, title), body);
  let plot = null;
  let data = [[], ...series.map(() => [])];
  let missing = false;

  loadUPlot().then((uPlot) => {
    if (!uPlot) {
      missing = true;
      element.dataset.missing = "true";
      body.replaceChildren(h("div", { class: "chart-missing" },
        "Charts are not installed. Run ", h("code", {}, INSTALL_HINT), " and reload."));
      return;
    }
    const fmt = UNIT_FORMAT[unit] || UNIT_FORMAT[""];
    const width = Math.max(240, body.clientWidth || 480);
    plot = new uPlot({
      width, height: 220,
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false }, y: logY ? { distr: 3 } : {} },
      axes: [
        { ...AXIS, label: xLabel, size: 42, ...(xLabel === "step" ? { incrs: STEP_INCRS } : {}),
          ...(xUnit === "duration" ? { values: (u, splits) => splits.map(clockTick) } : {}) },
        { ...AXIS, label: unit && unit !== "bytes" ? `${yLabel} (${unit})` : yLabel, size: unit === "bytes" ? 72 : 60,
          values: (u, splits) => splits.map(fmt), ...(unit === "bytes" ? { incrs: BYTE_INCRS } : {}) },
      ],
      series: [
        { label: xLabel, value: (u, v) => (v == null ? "—" : xUnit === "duration" ? clockTick(v) : num(v, 5)) },
        ...series.map((s, i) => ({
          label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: 1.75,
          points: { size: 4 }, spanGaps: true,
          value: (u, v) => (v == null ? "—" : unit === "bytes" ? bytes(v) : `${num(v, 4)}${unit && unit !== "bytes" ? ` ${unit}` : ""}`),
        })),
      ],
    }, data, body);
    new ResizeObserver(() => {
      const w = body.clientWidth;
      if (w && Math.abs(w - plot.width) > 2) plot.setSize({ width: w, height: 220 });
    }).observe(body);
  });

  return {
    element,
    setData(xs, ...ys) {
      data = [xs, ...ys];
      const points = ys.length ? Math.max(...ys.map((y) => y.filter((v) => v !== null && v !== undefined).length)) : 0;
      element.dataset.points = String(points);
      const empty = !xs.length;
      element.classList.toggle("chart-empty", empty);
      if (plot) plot.setData(data);
    },
    get missing() { return missing; },
  };
}
