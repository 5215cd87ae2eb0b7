// Job: status and error first, then progress, live charts, the event log, checkpoints and the spec.

import { AuthError, ApiError, api, apiDelete, streamEvents } from "../api.js";
import { DASH, bytes, dateTime, duration, h, isNum, num, percent, rate, secondsSince } from "../format.js";
import { describeError, poll } from "../live.js";
import { TERMINAL, evalPoint, isCpuJob, normalizeJob, normalizeSample, offloadFigures, unwrapEvent } from "../model.js";
import { errorState, failureBanner, progressBar, stat, statusBadge } from "../widgets.js";
import { eventLog } from "./event-log.js";
import { loadHistory, loadMetrics, makeCharts, seriesStore } from "./job-series.js";
import { evalChart, samplesCard } from "./job-llm.js";
import { checkpointsCard } from "./checkpoints.js";
import { specCard } from "./spec.js";

export async function render(root, { params: [jobId], ctx }) {
  const path = `/v1/jobs/${encodeURIComponent(jobId)}`;
  let job;
  try {
    job = normalizeJob(await api(path));
  } catch (err) {
    if (err instanceof AuthError) throw err;
    root.append(h("p", {}, h("a", { href: "#/jobs", class: "back" }, "← Jobs")),
      err instanceof ApiError && err.status === 404
        ? h("div", { class: "empty" }, h("p", { class: "empty-title" }, "No such job."), h("p", { class: "muted mono" }, jobId))
        : h("div", {}, errorState(describeError(err), { title: "Could not load this job." }),
          h("button", { class: "btn", type: "button", onclick: () => window.dispatchEvent(new HashChangeEvent("hashchange")) }, "Try again")));
    return () => {};
  }

  const header = h("div", { class: "job-head" });
  const errorSlot = h("div", { class: "error-slot" });
  const banner = h("div", { class: "banner-slot" });
  const stats = h("div", { class: "stats" });
  const series = seriesStore();
  const charts = makeCharts({ cpu: isCpuJob(job) });
  const log = eventLog();
  const checkpoints = checkpointsCard(jobId, ctx);
  const evals = evalChart();
  const samples = samplesCard(path);
  const chartGrid = h("div", { class: "chart-grid" }, charts.all.map((c) => c.element), evals.element);
  const noSteps = h("div", { class: "empty", id: "no-steps", hidden: true },
    h("p", { class: "empty-title" }, "No training steps were recorded."),
    h("p", { class: "muted" }, "The job ended before its first step; its events below say why."));
  root.append(
    h("p", {}, h("a", { href: "#/jobs", class: "back" }, "← Jobs")),
    header, errorSlot, banner, stats,
    h("h2", { class: "section-title" }, "Training"), chartGrid, noSteps,
    samples.element,
    h("div", { class: "two-col" }, log.element, h("div", { class: "stack" }, checkpoints.element, specCard(job))));

  function draw() {
    const nothing = TERMINAL.has(job.status) && !series.last();
    chartGrid.hidden = nothing;
    noSteps.hidden = !nothing;
    drawHeader(header, job, act);
    drawError(errorSlot, job);
    drawStats(stats, job, series.last());
  }

  async function act(action) {
    if (action === "delete") return remove();
    try {
      job = normalizeJob(await api(`${path}/${action}`, { method: "POST" }));
      ctx.toast(`${action === "cancel" ? "Cancel" : action === "pause" ? "Pause" : "Resume"} requested.`, "info");
      draw();
    } catch (err) {
      if (err instanceof AuthError) return ctx.needToken(err.message);
      ctx.toast(err.message, "error");
    }
  }

  async function remove() {
    if (!window.confirm(`Delete job ${job.name || job.id} with its events, checkpoints and logs?`)) { draw(); return; }
    try {
      await apiDelete(path);
      ctx.toast("Job deleted.", "info");
      window.location.hash = "#/jobs";
    } catch (err) {
      if (err instanceof AuthError) return ctx.needToken(err.message);
      ctx.toast(err.message, "error");
      draw();
    }
  }

  draw();
  // Load the stored series and the log's other events first, then open the stream from the last event the
  // page has: it brings only what is new, never a replay of the whole job (same step = same point, an
  // event seen twice is shown once).
  let after = 0;
  try {
    // The log shows every stored event in order: the steps come with the series, the rest from the history.
    const stored = [];
    after = await loadMetrics(path, series, (points) => evals.add(points), (rows) => stored.push(...rows));
    await loadHistory(path, (item) => stored.push(unwrapEvent(item)));
    stored.sort((a, b) => a.event_id - b.event_id);
    for (const event of stored) log.add(event.event_id, event.type, event);
  } catch (err) {
    if (err instanceof AuthError) throw err;
    banner.replaceChildren(errorState(describeError(err), { title: "Metrics unavailable." }));
  }
  charts.update(series);
  draw();
  checkpoints.refresh();
  samples.load().catch(() => {});  // the stream below brings new ones

  let streamEnded = false;
  const stopStream = streamEvents(jobId, {
    after,
    onEvent: ({ id, type, data }) => {
      if (type === "end") { streamEnded = true; return; }  // the job finished and every event is out
      const event = unwrapEvent(data);
      const kind = event.type || type;
      log.add(id, kind, event);
      if (kind === "step") { series.addRows([event]); charts.schedule(series, () => drawStats(stats, job, series.last())); }
      if (kind === "checkpoint") checkpoints.refresh();
      if (kind === "eval") evals.add([evalPoint(event)]);
      if (kind === "sample") samples.add([normalizeSample(event, path, id)]);
      if (kind === "status" || kind === "finished" || kind === "failed") refreshJob().catch(() => {});
    },
    onState: (state) => log.setState(state),
    onAuthError: () => ctx.needToken(),
    // A finished job's stream ends for good; a live one is picked up again where it stopped.
    shouldReconnect: () => !streamEnded && !TERMINAL.has(job.status),
  });
  async function refreshJob() {
    const before = job.status;
    job = normalizeJob(await api(path));
    banner.replaceChildren();
    draw();
    if (before !== job.status) checkpoints.refresh();
  }
  const stopPoll = poll(refreshJob, { ctx, intervalMs: 2000, onError: (err) => banner.replaceChildren(failureBanner(err)) });

  return () => { stopStream(); stopPoll(); };
}

function drawHeader(header, job, act) {
  // The service says what it accepts now (allowed_actions: its status table, and a pending stop request).
  const allowed = (action) => job.actions.includes(action);
  const button = (action, label, cls) => h("button", {
    class: `btn ${cls}`, type: "button", "data-action": action, disabled: !allowed(action),
    title: allowed(action) ? null : job.stopRequested ? `${job.stopRequested} already requested` : `Not possible while ${job.status}`,
    onclick: (e) => { e.currentTarget.disabled = true; act(action); },
  }, label);
  header.replaceChildren(
    h("div", { class: "job-title" },
      h("div", { class: "row" }, h("h1", {}, job.name || "Job"), statusBadge(job.status)),
      h("div", { class: "muted small job-meta" },
        h("span", { class: "mono", id: "job-id" }, job.id),
        job.gpu || job.worker ? h("span", {}, `on ${[job.gpu, job.worker && String(job.worker) !== job.gpu ? `worker ${job.worker}` : null].filter(Boolean).join(" · ")}`) : null,
        job.createdAt ? h("span", {}, `submitted ${dateTime(job.createdAt)}`) : null,
        isNum(job.attempt) && job.attempt > 1 ? h("span", {}, `attempt ${job.attempt}`) : null,
        job.stopRequested ? h("span", { class: "stopping" }, `${job.stopRequested} requested…`) : null)),
    h("div", { class: "actions" }, button("pause", "Pause", ""), button("resume", "Resume", ""), button("cancel", "Cancel", "danger"),
      // A finished job only (the service lists delete among its allowed actions then).
      allowed("delete") ? button("delete", "Delete", "danger") : null));
}

function drawError(slot, job) {
  if (!job.error || !["failed", "interrupted", "cancelled"].includes(job.status)) { slot.replaceChildren(); return; }
  slot.replaceChildren(h("section", { class: "card failure", id: "job-error", role: "alert" },
    h("h2", {}, job.status === "failed" ? "This job failed" : `This job is ${job.status}`),
    job.error.code ? h("div", { class: "mono small muted" }, job.error.code) : null,
    h("pre", { class: "error-message" }, job.error.message),
  ));
}

function drawStats(root, job, last) {
  const from = (key) => (isNum(last?.[key]) ? last[key] : job[key]);
  const ran = job.startedAt && job.finishedAt ? secondsSince(job.startedAt) - secondsSince(job.finishedAt)
    : job.startedAt ? secondsSince(job.startedAt) : null;
  const elapsed = isNum(last?.elapsed) ? last.elapsed : isNum(job.elapsed) ? job.elapsed : ran;
  const pct = isNum(job.percent) ? job.percent : job.status === "succeeded" ? 100 : null;
  root.replaceChildren(
    h("div", { class: "stat stat-wide", "data-stat": "progress" },
      h("div", { class: "stat-label" }, "Progress"),
      h("div", { class: "stat-value" }, percent(pct),
        h("span", { class: "muted small" }, isNum(job.step) && isNum(job.total) ? ` step ${job.step} of ${job.total}` : "")),
      progressBar(pct, job.status),
      h("div", { class: "stat-sub muted small" },
        job.status === "running" && isNum(job.eta) ? `ETA ${duration(job.eta)} · ` : "", `elapsed ${duration(elapsed)}`)),
    stat("Loss", num(from("loss")), { id: "loss" }),
    stat("Learning rate", num(from("lr"), 3), { id: "lr" }),
    stat("Throughput", rate(from("samplesPerS"), "samples/s"), { id: "throughput", sub: throughputSub(last, from) }),
    ...(isNum(last?.reward) ? [stat("Reward", num(last.reward, 3), { id: "reward",
      sub: `std ${num(last.rewardStd, 3)} · ${num(last.completionLength, 3)} tokens a completion` })] : []),
    isCpuJob(job)
      ? stat("Host memory", bytes(from("hostRss")), { id: "gpu-mem", sub: "runs on the CPU: its memory is the host's (RSS)" })
      : stat("GPU memory", bytes(from("allocated")), { id: "gpu-mem",
        sub: `reserved ${bytes(from("reserved"))} · peak ${bytes(from("peak"))}` }),
    stat("Pinned host", bytes(from("pinned")), { id: "pinned", sub: isNum(from("hostRss")) ? `RSS ${bytes(from("hostRss"))}` : null }),
    offloadStat(last, job),
  );
}

/** Tokens/s under the throughput: a grpo step's sampling and training apart, else the step's tokens/s. */
function throughputSub(last, from) {
  if (isNum(last?.generationTokensPerS)) {
    return `generation ${rate(last.generationTokensPerS, "tokens/s")} · training ${rate(last.trainingTokensPerS, "tokens/s")}`;
  }
  return isNum(from("tokensPerS")) ? rate(from("tokensPerS"), "tokens/s") : null;
}

function offloadStat(last, job) {
  const o = isNum(last?.h2d) ? last : offloadFigures(job.offload);
  if (!isNum(o.h2d)) return stat("Offload", DASH, { id: "offload", sub: "no offload figures (offload off or not started)" });
  if (isCpuJob(job) && !(o.h2dBytes > 0)) {
    return stat("Offload", "on the CPU", { id: "offload", sub: "the target device is the host: no copies to move" });
  }
  return stat("Offload H→D", `${num(o.h2d, 3)} GB/s`, { id: "offload",
    sub: `D→H ${num(o.d2h, 3)} GB/s · ${num(o.copyWait, 3)} s waiting on copies in all`
      + (isNum(o.kept) && o.kept > 0 ? ` · ${bytes(o.kept)} of weights kept on the GPU` : "")
      + (isNum(o.reused) && o.reused > 0 ? ` · ${bytes(o.reused)} reused from the ring in all` : "") });
}
