// The live event log. The stored events arrive first (loaded on page load), then the stream adds new ones
// live, so a reload shows the whole history again and continues from there.

import { bytes, clockTime, h, num } from "../format.js";

const MAX_ROWS = 400;

export function eventLog() {
  const list = h("ol", { class: "events", id: "event-log" });
  const state = h("span", { class: "stream-state muted small", "data-state": "connecting" }, "connecting…");
  const showSteps = h("input", { type: "checkbox", checked: true, id: "show-steps" });
  const count = h("span", { class: "muted small" });
  const element = h("section", { class: "card log-card" },
    h("div", { class: "card-head" },
      h("h3", { class: "card-title" }, "Events ", count),
      h("label", { class: "small muted toggle" }, showSteps, " steps"), state),
    list, h("p", { class: "empty small", id: "events-empty" }, "No events yet."));
  const seen = new Set();
  let total = 0;
  let pending = [];

  // A replay brings thousands of events at once: add them to the page once a frame, and keep
  // following the end only if the reader was already there.
  function flush() {
    const stick = list.scrollHeight - list.scrollTop - list.clientHeight < 24;
    const rows = pending.slice(-MAX_ROWS);
    pending = [];
    element.querySelector("#events-empty")?.remove();
    count.textContent = total > MAX_ROWS ? `(${total}, the last ${MAX_ROWS} shown)` : `(${total})`;
    list.append(...rows);
    while (list.children.length > MAX_ROWS) list.firstElementChild.remove();
    if (stick) list.scrollTop = list.scrollHeight;
  }
  showSteps.addEventListener("change", () => element.classList.toggle("hide-steps", !showSteps.checked));

  return {
    element,
    add(eventId, type, event) {
      const id = eventId == null ? null : String(eventId);  // the stream's ids are text, stored ones numbers
      if (id !== null && seen.has(id)) return;
      if (id !== null) seen.add(id);
      total += 1;
      pending.push(h("li", { class: `event event-${type}`, "data-event-id": id ?? "", "data-type": type },
        timeCell(event), h("span", { class: "event-type" }, type), h("span", { class: "event-text" }, describe(type, event))));
      if (pending.length === 1) requestAnimationFrame(flush);
    },
    setState(value) {
      state.dataset.state = value;
      state.textContent = { live: "● live", ended: "stream ended", reconnecting: "reconnecting…" }[value] || value;
    },
  };
}

// One sentence per declared event type (the API's StoredEvent union); each reads only its schema's fields.
const DESCRIBE = { step: describeStep, started: describeStarted, checkpoint: describeCheckpoint, eval: describeEval,
  sample: describeSample, finished: describeFinished, failed: describeFailed, log: describeLog, status: describeStatus,
  stop_requested: describeStopRequested, cache_progress: describeCacheProgress };

// The reader's envelope fields (unwrapEvent's): the time column shows the moment, the others are no news.
const ENVELOPE = new Set(["time", "created_at", "event_id", "type", "attempt"]);

function describe(type, e) {
  if (DESCRIBE[type]) return DESCRIBE[type](e);
  // A type this page does not know yet: its own fields, without epoch floats the time column already says.
  return JSON.stringify(Object.fromEntries(Object.entries(e).filter(([key]) => !ENVELOPE.has(key))));
}

/** When the event happened, in the reader's local time (the full date on hover); a step point's wall-clock
 * seconds (`time`) or a stored event's `created_at`. */
export function timeCell(e) {
  const when = clockTime(e.time ?? e.created_at);
  return when ? h("time", { class: "event-time", datetime: when.iso, title: when.title }, when.text)
    : h("span", { class: "event-time muted" }, "—");
}

/** @param {StepEvent} e */
function describeStep(e) {
  return `step ${e.step}/${e.total_steps} · loss ${num(e.loss)} · lr ${num(e.lr, 3)}` +
    (e.device_peak_bytes ? ` · peak ${bytes(e.device_peak_bytes)}` : "");
}

/** @param {StartedEvent} e */
function describeStarted(e) {
  return e.resumed_from_step ? `resumed from step ${e.resumed_from_step} of ${e.total_steps}` : `started, ${e.total_steps} steps`;
}

/** @param {CheckpointEvent} e */
function describeCheckpoint(e) {
  return `checkpoint ${e.name} at step ${e.step}`;
}

/** @param {EvalEvent} e */
function describeEval(e) {
  return `eval at step ${e.step} · loss ${num(e.eval_loss)}` + (e.perplexity != null ? ` · ppl ${num(e.perplexity, 3)}` : "")
    + (e.preference != null ? ` · reward accuracy ${num(e.preference.rewards_accuracies, 3)}` : "");
}

/** @param {SampleEvent} e */
function describeSample(e) {
  return `sample at step ${e.step}${e.prompt != null ? ` · “${e.prompt}”` : ""}` +
    (e.artifact_path ? ` · ${e.artifact_path}` : e.text != null ? ` · ${e.text.slice(0, 80)}` : "");
}

/** @param {CacheProgressEvent} e */
function describeCacheProgress(e) {
  return `cached ${e.step}/${e.total_steps} · ${num(e.samples_per_s)} samples/s · text encoder ${num(e.text_encoder_s)} s · VAE ${num(e.vae_s)} s`;
}

/** @param {FinishedEvent} e */
function describeFinished(e) {
  return `finished: ${e.status} at step ${e.step}`;
}

/** @param {FailedEvent} e */
function describeFailed(e) {
  return `${e.error}: ${e.message}`;
}

/** @param {LogEvent} e */
function describeLog(e) {
  return `[${e.level}] ${e.message}`;
}

/** @param {StatusEvent} e */
function describeStatus(e) {
  return `${e.previous ? `${e.previous} → ` : ""}${e.status} · ${e.reason}` + (e.error ? ` · ${e.error.message}` : "");
}

/** @param {StopRequestedEvent} e */
function describeStopRequested(e) {
  return `${e.kind} requested`;
}
