// The job page's time series: the stored points, the live ones from the stream, and the six charts (and a grpo
// job's five more: reward, KL, completion length, clip fraction, generation and training tokens/s).

import { api } from "../api.js";
import { lineChart } from "../charts.js";
import { isNum } from "../format.js";
import { bytesMoved, eventsPage, flattenStep, hasGrpo, metricsPage } from "../model.js";

/** The stored series, page by page (`?after=` cursor) until the service says there is no more. */
export async function loadMetrics(path, series, onEval = () => {}, onSteps = () => {}) {
  let after = 0;
  for (let page = 0; page < 100; page += 1) {
    const { rows, evals, nextCursor, hasMore } = metricsPage(await api(`${path}/metrics?after=${after}&limit=10000`));
    series.addRows(rows);
    onSteps(rows);
    onEval(evals);  // the evaluations in the same range of events
    const next = isNum(nextCursor) ? nextCursor : after;
    if (!hasMore || next === after) return next;
    after = next;
  }
  return after;
}

/** Every stored event but the steps (the series holds those), oldest first: the event log's history. */
export async function loadHistory(path, add) {
  let after = 0;
  for (let page = 0; page < 20; page += 1) {
    const { items, nextCursor, hasMore } = eventsPage(await api(`${path}/events?after=${after}&limit=1000&exclude=step`));
    for (const item of items) add(item);
    if (!hasMore || nextCursor === after) return;
    after = nextCursor;
  }
}

/** Step rows keyed by step: a step seen again (resumed from a checkpoint) replaces the old point. */
export function seriesStore() {
  const byStep = new Map();
  let sorted = null;  // rows in step order, rebuilt only when asked for after a change
  let lastStep = null;
  return {
    addRows(rows) {
      for (const row of rows) {
        const step = flattenStep(row);
        if (!isNum(step.step)) continue;
        // A run resumed from a checkpoint repeats the steps after it; the newer figures win.
        byStep.set(step.step, step);
        if (lastStep === null || step.step >= lastStep) lastStep = step.step;
        sorted = null;
      }
    },
    rows() {
      sorted ??= [...byStep.values()].sort((a, b) => a.step - b.step);
      return sorted;
    },
    last() { return lastStep === null ? null : byStep.get(lastStep); },
  };
}

/** The job page's charts; a CPU job (`cpu`) charts host memory only, and no chart of copies that never happen. */
export function makeCharts({ cpu = false } = {}) {
  const loss = lineChart({ title: "Loss", xLabel: "step", yLabel: "loss", series: [{ label: "loss" }], testId: "loss",
    logToggle: true });
  const lr = lineChart({ title: "Learning rate", xLabel: "step", yLabel: "learning rate", series: [{ label: "lr", color: "#7048e8" }], testId: "lr" });
  const memoryKeys = cpu ? ["pinned", "hostRss"] : ["allocated", "reserved", "peak", "pinned", "hostRss"];
  const memory = lineChart({ title: cpu ? "Host memory over time" : "Memory over time", xLabel: "time since the first step",
    xUnit: "duration", yLabel: "memory", unit: "bytes", testId: "memory",
    series: [...(cpu ? [] : [{ label: "GPU allocated" }, { label: "GPU reserved", color: "#0c8599" }, { label: "GPU peak", color: "#c2255c" }]),
      { label: "pinned host", color: "#d9480f" }, { label: "host RSS", color: "#868e96" }] });
  const throughput = lineChart({ title: "Throughput", xLabel: "step", yLabel: "samples", unit: "samples/s", testId: "throughput",
    series: [{ label: "samples/s", color: "#2b8a3e" }] });
  const transfer = lineChart({ title: "Offload transfers", xLabel: "step", yLabel: "rate", unit: "GB/s", testId: "transfer",
    series: [{ label: "host → GPU" }, { label: "GPU → host", color: "#d9480f" }] });
  const wait = lineChart({ title: "Time waiting on copies", xLabel: "step", yLabel: "wait per step", unit: "ms", testId: "copy-wait",
    series: [{ label: "copy wait", color: "#c2255c" }] });
  const grpo = grpoCharts();
  const all = [loss, lr, memory, throughput, transfer, wait, ...grpo.all];
  let pending = false;
  function update(store) {
    const rows = store.rows();
    const col = (key) => rows.map((r) => (isNum(r[key]) ? r[key] : null));
    const steps = col("step");
    loss.setData(steps, col("loss"));
    lr.setData(steps, col("lr"));
    // Over wall-clock time since the first step, so a resumed run continues to the right instead of
    // starting again at zero (its elapsed_s restarts with each attempt).
    const clock = rows.every((r) => isNum(r.time)) ? "time" : "elapsed";
    const timed = rows.filter((r) => isNum(r[clock]));
    const t0 = timed.length ? Math.min(...timed.map((r) => r[clock])) : 0;
    memory.setData(timed.map((r) => r[clock] - t0), ...memoryKeys.map(
      (k) => timed.map((r) => (isNum(r[k]) ? r[k] : null))));
    throughput.setData(steps, col("samplesPerS"));
    // On the CPU nothing crosses to a GPU: no chart of zeros where no byte moved.
    const copies = !cpu || bytesMoved(rows);
    transfer.element.hidden = !copies;
    wait.element.hidden = !copies;
    transfer.setData(steps, col("h2d"), col("d2h"));
    wait.setData(steps, perStepWaitMs(rows));
    grpo.update(rows, steps, col);
  }
  // Many step events arrive at once on replay: redraw charts and figures at most once a frame.
  function schedule(store, alsoDraw = () => {}) {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; update(store); alsoDraw(); });
  }
  return { all, update, schedule };
}

/** A grpo job's charts, hidden until a step carries grpo figures (every other job never shows them). */
export function grpoCharts() {
  const reward = lineChart({ title: "Reward", xLabel: "step", yLabel: "reward", testId: "reward",
    series: [{ label: "mean" }, { label: "std", color: "#868e96" }] });
  const kl = lineChart({ title: "KL to the reference", xLabel: "step", yLabel: "KL", testId: "kl",
    series: [{ label: "KL", color: "#7048e8" }] });
  const length = lineChart({ title: "Completion length", xLabel: "step", yLabel: "tokens", testId: "completion-length",
    series: [{ label: "mean tokens", color: "#0c8599" }] });
  const clip = lineChart({ title: "Clip fraction", xLabel: "step", yLabel: "share of tokens", testId: "clip-fraction",
    series: [{ label: "clipped", color: "#c2255c" }] });
  const tokens = lineChart({ title: "Generation and training", xLabel: "step", yLabel: "tokens", unit: "tokens/s",
    testId: "grpo-tokens", series: [{ label: "generation", color: "#2b8a3e" }, { label: "training", color: "#d9480f" }] });
  const all = [reward, kl, length, clip, tokens];
  for (const chart of all) chart.element.hidden = true;
  return {
    all,
    update(rows, steps, col) {
      const shown = hasGrpo(rows);
      for (const chart of all) chart.element.hidden = !shown;
      // KL is null while training.grpo.beta is 0: no chart of a figure that is not computed.
      kl.element.hidden = !shown || !rows.some((r) => isNum(r.kl));
      if (!shown) return;
      reward.setData(steps, col("reward"), col("rewardStd"));
      kl.setData(steps, col("kl"));
      length.setData(steps, col("completionLength"));
      clip.setData(steps, col("clipRatio"));
      tokens.setData(steps, col("generationTokensPerS"), col("trainingTokensPerS"));
    },
  };
}

/**
 * The engine reports the total time compute waited on copies since the run (or attempt) started;
 * the chart shows it per step, in milliseconds. A drop in the total means a new attempt began.
 */
function perStepWaitMs(rows) {
  return rows.map((row, i) => {
    const prev = rows[i - 1];
    if (!isNum(row.copyWait)) return null;
    if (!prev || !isNum(prev.copyWait) || row.copyWait < prev.copyWait) return null;
    return (1000 * (row.copyWait - prev.copyWait)) / Math.max(1, row.step - prev.step);
  });
}
