// Turns the service's JSON into the plain shapes the pages draw. Field names follow issue 5 and
// docs/interfaces.md; `pick` tries the few spellings a field may have so one renamed key does not blank
// the page.

import { isNum, toMillis } from "./format.js";

export const STATUSES = ["queued", "running", "paused", "succeeded", "failed", "cancelled", "interrupted"];
export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

// What each button may do from each status; the service has the last word (409 with a reason).
export const ACTIONS = {
  pause: new Set(["running", "queued"]),
  resume: new Set(["paused", "interrupted", "failed"]),  // a failed job resumes from its last checkpoint
  cancel: new Set(["queued", "running", "paused", "interrupted"]),
};

/** The first defined value among dotted paths: pick(job, "progress.step", "step"). */
export function pick(obj, ...paths) {
  for (const path of paths) {
    let value = obj;
    for (const key of path.split(".")) {
      value = value == null ? undefined : value[key];
    }
    if (value !== undefined && value !== null) return value;
  }
  return null;
}

export function normalizeJob(raw) {
  const step = pick(raw, "progress.step", "step", "metrics.step", "latest_metrics.step");
  const total = pick(raw, "progress.total_steps", "progress.total", "total_steps", "metrics.total_steps");
  let pct = pick(raw, "progress.percent", "percent");
  if (!isNum(pct) && isNum(step) && isNum(total) && total > 0) pct = (100 * step) / total;
  let eta = pick(raw, "progress.eta_s", "progress.eta_seconds", "progress.eta", "eta_s", "metrics.eta_s");
  const finish = pick(raw, "progress.estimated_finish", "estimated_finish");
  if (!isNum(eta) && finish) {
    const t = toMillis(finish);
    if (t !== null) eta = Math.max(0, (t - Date.now()) / 1000);
  }
  const m = (...names) => pick(raw, ...names.flatMap((n) => [`metrics.${n}`, `memory.${n}`, `progress.${n}`, n]));
  const error = normalizeError(pick(raw, "error"));
  return {
    raw,
    id: String(pick(raw, "id", "job_id")),
    name: pick(raw, "name", "spec.name", "spec.job.name") || "",
    status: String(pick(raw, "status") || "unknown").toLowerCase(),
    spec: pick(raw, "spec"),
    specText: pick(raw, "spec_text", "spec_yaml", "source", "yaml"),
    step, total, percent: pct, eta,
    loss: m("loss"),
    lr: m("lr", "learning_rate"),
    samplesPerS: m("samples_per_s"),
    tokensPerS: m("tokens_per_s"),
    elapsed: m("elapsed_s"),
    offload: pick(raw, "offload", "metrics.offload"),
    allocated: m("device_allocated_bytes"),
    reserved: m("device_reserved_bytes"),
    peak: m("device_peak_bytes", "peak_device_bytes"),
    pinned: m("pinned_bytes", "pinned_host_bytes"),
    hostRss: m("host_rss_bytes"),
    gpu: formatGpu(pick(raw, "gpu", "device", "worker.gpu")),
    worker: pick(raw, "worker", "worker_id", "worker.id", "worker.name"),
    createdAt: pick(raw, "created_at", "created", "submitted_at"),
    startedAt: pick(raw, "started_at"),
    finishedAt: pick(raw, "finished_at", "ended_at"),
    attempt: pick(raw, "attempt"),
    retries: pick(raw, "retries"),
    stopRequested: pick(raw, "stop_requested"),
    error,
  };
}

function normalizeError(error) {
  if (!error) return null;
  if (typeof error === "string") return { code: null, message: error };
  return { code: error.code || error.type || null, message: error.message || error.detail || JSON.stringify(error), hint: error.hint || null };
}

function formatGpu(gpu) {
  if (gpu === null || gpu === undefined || gpu === "") return null;
  if (typeof gpu === "object") {
    const index = pick(gpu, "index", "id");
    const name = pick(gpu, "name");
    return [index !== null ? `#${index}` : null, name].filter(Boolean).join(" ") || null;
  }
  if (isNum(gpu)) return `GPU ${gpu}`;
  return String(gpu);
}

/** The list body is `{data, next_cursor}`; tolerate a bare list too. */
export function listOf(body, ...keys) {
  if (Array.isArray(body)) return body;
  for (const key of ["data", "items", ...keys]) if (Array.isArray(body?.[key])) return body[key];
  return [];
}

/** Metric rows from `/metrics`: a list of step rows, `{data: rows}`, or columns `{series: {loss: [...]}}`. */
export function metricRows(body) {
  const rows = listOf(body, "metrics", "steps", "series");
  if (rows.length) return rows;
  const columns = body?.series || body?.columns;
  if (columns && typeof columns === "object") {
    const n = Math.max(0, ...Object.values(columns).map((c) => (Array.isArray(c) ? c.length : 0)));
    return Array.from({ length: n }, (_, i) => Object.fromEntries(
      Object.entries(columns).map(([key, col]) => [key, Array.isArray(col) ? col[i] : null])));
  }
  return [];
}

/** A stream or events-list item is `{id, type, attempt, data: {...the job's event}}`: the event, flat. */
export function unwrapEvent(item, fallbackType) {
  if (item && typeof item === "object" && item.data && typeof item.data === "object" && "job_id" in item) {
    return { ...item.data, type: item.type || item.data.type, attempt: item.attempt, created_at: item.created_at };
  }
  if (item && typeof item === "object") return { type: fallbackType, ...item };
  return { type: fallbackType, message: String(item ?? "") };
}

/** Flatten one step row: offload figures may sit under `offload`. */
export function flattenStep(row) {
  const off = row.offload || {};
  return {
    step: pick(row, "step"),
    loss: pick(row, "loss"),
    lr: pick(row, "lr", "learning_rate"),
    samplesPerS: pick(row, "samples_per_s"),
    tokensPerS: pick(row, "tokens_per_s"),
    elapsed: pick(row, "elapsed_s"),
    // Wall-clock seconds: `time` on /metrics points, `created_at` on streamed events.
    time: isNum(row.time) ? row.time : toMillis(row.created_at) !== null ? toMillis(row.created_at) / 1000 : null,
    allocated: pick(row, "device_allocated_bytes"),
    reserved: pick(row, "device_reserved_bytes"),
    peak: pick(row, "device_peak_bytes"),
    pinned: pick(row, "pinned_bytes"),
    hostRss: pick(row, "host_rss_bytes"),
    h2d: pick(off, "last_step_h2d_gbps") ?? pick(row, "h2d_gbps", "last_step_h2d_gbps", "offload_h2d_gbps"),
    d2h: pick(off, "last_step_d2h_gbps") ?? pick(row, "d2h_gbps", "last_step_d2h_gbps", "offload_d2h_gbps"),
    copyWait: pick(off, "copy_wait_seconds") ?? pick(row, "copy_wait_seconds", "offload_copy_wait_seconds"),
    h2dBytes: pick(off, "h2d_bytes") ?? pick(row, "h2d_bytes"),
  };
}

/** The problems of a failed validation, from either a 200 validate body or a 422 error body. */
export function problemsOf(body) {
  if (!body || typeof body !== "object") return [];
  // The service answers `{error: {code, message, problems}}`; FastAPI's default is `{detail: [...]}`.
  const detail = body.error ?? body.detail ?? body;
  const list = Array.isArray(detail) ? detail : (detail.problems || detail.errors || body.problems || []);
  return list.map((p) => ({
    path: p.path || (Array.isArray(p.loc) ? p.loc.filter((x) => x !== "body").join(".") : "") || "",
    message: p.message || p.msg || String(p),
    line: isNum(p.line) ? p.line : null,
    suggestion: p.suggestion || null,
  }));
}

/** The fit estimate from a validate body. */
export function estimateOf(body) {
  const e = pick(body, "estimate", "fit", "memory_estimate") || {};
  const fits = pick(e, "fits", "fit") ?? pick(body, "fits");
  const devices = (pick(e, "devices", "gpus") || []).filter((d) => d && typeof d === "object");
  const sizes = devices.map((d) => pick(d, "memory_total_bytes", "total_bytes")).filter(isNum);
  return {
    fits: typeof fits === "boolean" ? fits : null,
    peak: pick(e, "peak_device_bytes", "peak_gpu_bytes"),
    pinned: pick(e, "pinned_host_bytes", "pinned_bytes"),
    gpuBytes: sizes.length ? Math.max(...sizes) : pick(e, "gpu_memory_bytes", "largest_gpu_bytes"),
    hostAvailable: pick(e, "host_available_bytes"),
    devices,
    notes: pick(e, "notes") || [],
    reason: pick(e, "reason", "message"),
    present: Object.keys(e).length > 0,
  };
}
