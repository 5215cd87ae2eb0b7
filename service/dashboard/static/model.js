// Turns the service's JSON into the plain shapes the pages draw. Every field read here is one the API
// declares: each function that takes an API object names its OpenAPI schema with `@param {Schema} name`,
// and tests/service/dashboard/test_dashboard_contract.py fails when a field read from it is missing from
// /openapi.json. No guessed spellings, no copy of the server's tables: what a job allows comes with it
// (`allowed_actions`).

import { toMillis } from "./format.js";

export const STATUSES = ["queued", "running", "paused", "succeeded", "failed", "cancelled", "interrupted"];
export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

/**
 * A job as the pages draw it.
 * @param {JobPublic} raw
 */
export function normalizeJob(raw) {
  const progress = raw.progress;
  const metrics = raw.metrics;
  const memory = raw.memory;
  return {
    raw,
    id: raw.id,
    name: raw.name || "",
    status: raw.status,
    spec: raw.spec,
    specText: raw.spec_text,
    step: progress?.step ?? null,
    total: progress?.total_steps ?? null,
    percent: progress?.percent ?? null,
    eta: progress?.eta_s ?? null,
    estimatedFinish: progress?.estimated_finish ?? null,
    elapsed: progress?.elapsed_s ?? null,
    loss: metrics?.loss ?? null,
    lr: metrics?.lr ?? null,
    samplesPerS: metrics?.samples_per_s ?? null,
    tokensPerS: metrics?.tokens_per_s ?? null,
    offload: raw.offload,
    allocated: memory?.device_allocated_bytes ?? null,
    reserved: memory?.device_reserved_bytes ?? null,
    peak: memory?.device_peak_bytes ?? null,
    pinned: memory?.pinned_bytes ?? null,
    hostRss: memory?.host_rss_bytes ?? null,
    gpu: raw.device,
    worker: raw.worker,
    createdAt: raw.created_at,
    startedAt: raw.started_at,
    finishedAt: raw.finished_at,
    attempt: raw.attempt,
    retries: raw.retries,
    stopRequested: raw.stop_requested,
    actions: raw.allowed_actions,
    error: raw.error ? normalizeError(raw.error) : null,
  };
}

/** @param {JobError} error */
function normalizeError(error) {
  return { code: error.code, message: error.message };
}

/**
 * One `/metrics` page: its step points, the evaluations in the same range of events, and the cursor.
 * @param {MetricsPublic} body
 */
export function metricsPage(body) {
  return { rows: body.data, evals: body.eval.map(evalPoint), nextCursor: body.next_cursor, hasMore: body.has_more };
}

/**
 * One `/events` page: the stored events (each read by `unwrapEvent`) and the cursor.
 * @param {EventsPublic} body
 */
export function eventsPage(body) {
  return { items: body.data, nextCursor: body.next_cursor, hasMore: body.has_more };
}

/**
 * One `/v1/jobs` page; `more` when the service holds older jobs than it sent.
 * @param {JobsPublic} body
 */
export function jobsPage(body) {
  return { jobs: body.data.map(normalizeJob), more: Boolean(body.next_cursor) };
}

/**
 * An evaluation as the eval chart draws it: a `/metrics` `eval` point, or a streamed eval event.
 * @param {EvalPoint} point
 */
export function evalPoint(point) {
  return { step: point.step, evalLoss: point.eval_loss, perplexity: point.perplexity ?? null,
    rewardAccuracy: point.preference?.rewards_accuracies ?? null };  // dpo/orpo: no perplexity, a reward accuracy
}

/**
 * The samples of a `/samples` page.
 * @param {SamplesPublic} body
 */
export function samplesOf(body) {
  return body.data;
}

/**
 * A sample as the samples card draws it: a `/samples` point, or a streamed sample event through
 * `unwrapEvent` (no `url` yet: the API serves its artifact under the job's `samples/files/`).
 * @param {SamplePoint} sample
 */
export function normalizeSample(sample, jobPath, streamId = null) {
  const artifact = sample.artifact_path ?? null;
  return {
    // One key per event whichever way it came: the listing gives numbers, the stream strings.
    key: String(sample.event_id ?? streamId ?? `${sample.step}:${sample.prompt}`),
    step: sample.step,
    prompt: sample.prompt ?? null,
    text: sample.text ?? null,
    reward: sample.reward ?? null,  // grpo: the graders' reward of this completion
    artifactPath: artifact,
    url: sample.url ?? (artifact ? `${jobPath}/samples/files/${artifact}` : null),
  };
}

/**
 * Whether the Merge button belongs on a checkpoint: the server's word, not a guess from its files.
 * @param {CheckpointPublic} ckpt
 */
export function mergeable(ckpt) {
  return ckpt.mergeable === true;
}

/**
 * The archive a merge answer offers for download.
 * @param {MergedPublic} body
 */
export function mergedArchive(body) {
  return { url: body.archive.url, name: body.archive.name, bytes: body.archive.bytes };
}

/**
 * The exports made from a checkpoint (a merged .tar, GGUF files, their Modelfiles), each a download.
 * @param {CheckpointPublic} ckpt
 */
export function checkpointExports(ckpt) {
  return (ckpt.exports || []).map((f) => ({ url: f.url, name: f.name, bytes: f.bytes, sha256: f.sha256 }));
}

/**
 * Whether a checkpoint is a Hugging Face model or adapter, which the GGUF export reads.
 * @param {CheckpointPublic} ckpt
 */
export function ggufExportable(ckpt) {
  return ckpt.files.some((f) => f.name === "adapter_config.json" || f.name === "config.json");
}

/**
 * The GGUF file a GGUF export answer offers for download.
 * @param {GgufPublic} body
 */
export function ggufFile(body) {
  return { url: body.gguf.url, name: body.gguf.name, bytes: body.gguf.bytes };
}

/**
 * A stored or streamed event (`{id, job_id, attempt, type, created_at, data}`) as one flat object; a step
 * event comes out shaped as a `/metrics` point (`event_id`, `time` in seconds).
 * @param {EventPublic} item
 */
export function unwrapEvent(item) {
  const millis = toMillis(item.created_at);
  return { ...item.data, type: item.type, attempt: item.attempt, created_at: item.created_at, event_id: item.id,
    time: millis === null ? null : millis / 1000 };
}

/**
 * One step as the charts draw it: a `/metrics` point, or a streamed step event through `unwrapEvent`.
 * @param {MetricPoint} row
 */
export function flattenStep(row) {
  const off = row.offload;
  return {
    step: row.step,
    loss: row.loss,
    lr: row.lr,
    samplesPerS: row.samples_per_s,
    tokensPerS: row.tokens_per_s,
    elapsed: row.elapsed_s,
    time: row.time,  // wall-clock seconds
    allocated: row.device_allocated_bytes,
    reserved: row.device_reserved_bytes,
    peak: row.device_peak_bytes,
    pinned: row.pinned_bytes,
    hostRss: row.host_rss_bytes,
    ...offloadFigures(off),
    ...grpoFigures(row.grpo),
  };
}

/**
 * A grpo step's figures (all null for other objectives): rewards, KL, completion length, clipping, and the
 * throughput of sampling and of training apart.
 * @param {GRPOMetrics} g
 */
export function grpoFigures(g) {
  return {
    reward: g?.reward_mean ?? null,
    rewardStd: g?.reward_std ?? null,
    kl: g?.kl ?? null,
    completionLength: g?.completion_length ?? null,
    clipRatio: g?.clip_ratio ?? null,
    generationTokensPerS: g?.generation_tokens_per_s ?? null,
    trainingTokensPerS: g?.training_tokens_per_s ?? null,
  };
}

/** Whether any step carries grpo figures: the page then charts rewards, KL, lengths and clipping. */
export function hasGrpo(rows) {
  return (rows || []).some((r) => typeof r.reward === "number");
}

/**
 * The engine's copy figures of a step (all null without offload).
 * @param {OffloadStats} off
 */
export function offloadFigures(off) {
  return {
    h2d: off?.last_step_h2d_gbps ?? null,
    d2h: off?.last_step_d2h_gbps ?? null,
    copyWait: off?.copy_wait_seconds ?? null,
    h2dBytes: off?.h2d_bytes ?? null,
    kept: off?.kept_resident_bytes ?? null,
    reused: off?.reused_bytes ?? null,
  };
}

/**
 * The problems of a refused spec (a 422 `{error: {code, message, problems}}`); none in a 200 answer.
 * @param {ErrorBody} body
 */
export function problemsOf(body) {
  return (body?.error?.problems || []).map(normalizeProblem);
}

/** @param {Problem} p */
function normalizeProblem(p) {
  return { path: p.path, message: p.message, line: p.line ?? null, suggestion: p.suggestion ?? null };
}

/**
 * The fit estimate of a validate answer.
 * @param {ValidationPublic} body
 */
export function estimateOf(body) {
  const e = body?.estimate;
  if (!e) return { present: false, reason: body?.estimate_error ?? null, devices: [], notes: [] };
  return { present: true, ...fitEstimate(e), reason: body.estimate_error ?? null };
}

/** @param {FitEstimate} e */
function fitEstimate(e) {
  const sizes = e.devices.map((d) => d.memory_total_bytes).filter((n) => typeof n === "number");
  return {
    fits: e.fits,
    peak: e.peak_device_bytes,
    pinned: e.pinned_host_bytes,
    gpuBytes: sizes.length ? Math.max(...sizes) : null,
    hostAvailable: e.host_available_bytes,
    devices: e.devices,
    notes: e.notes,
  };
}

/**
 * Whether a job trains on the CPU: its spec says so, or a CPU worker runs it. Its memory is the host's and
 * no bytes cross to a GPU, so the page speaks of host memory and shows no transfer charts.
 */
export function isCpuJob(job) {
  return job?.spec?.device === "cpu" || (!job?.gpu && String(job?.worker || "").startsWith("cpu"));
}

/**
 * What ran (or runs) a job, for the jobs list's GPU column: its GPU index(es), "CPU" for a CPU job (a CPU
 * worker's, or one whose spec says device: cpu on a GPU worker's slot), or null before a worker took it.
 */
export function ranOn(job) {
  if (!job?.worker) return null;
  return isCpuJob(job) || !job.gpu ? "CPU" : job.gpu;
}

/** Whether any step moved bytes between host and GPU (its copy rates or totals above zero). */
export function bytesMoved(rows) {
  return (rows || []).some((r) => r.h2d > 0 || r.d2h > 0 || r.h2dBytes > 0);
}

/**
 * A sample's text as shown: whitespace only (a model that learned to emit newlines) becomes a short note
 * instead of a block as tall as its line breaks.
 * @returns {{text: string, blank: boolean}}
 */
export function sampleText(text) {
  const raw = String(text ?? "");
  if (raw.trim()) return { text: raw, blank: false };
  return { text: raw ? `(whitespace only: ${raw.length} characters)` : "(empty)", blank: true };
}
