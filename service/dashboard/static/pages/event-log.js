// The live event log. The stored events arrive first (loaded on page load), then the stream adds new ones
// live, so a reload shows the whole history again and continues from there.

import { bytes, h, num } from "../format.js";

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
    add(id, type, event) {
      if (id !== null && seen.has(id)) return;
      if (id !== null) seen.add(id);
      total += 1;
      pending.push(h("li", { class: `event event-${type}`, "data-event-id": id ?? "", "data-type": type },
        h("span", { class: "event-type" }, type), h("span", { class: "event-text" }, describe(type, event))));
      if (pending.length === 1) requestAnimationFrame(flush);
    },
    setState(value) {
      state.dataset.state = value;
      state.textContent = { live: "● live", ended: "stream ended", reconnecting: "reconnecting…" }[value] || value;
    },
  };
}

function describe(type, e) {
  switch (type) {
    case "step":
      return `step ${e.step}${e.total_steps ? `/${e.total_steps}` : ""} · loss ${num(e.loss)} · lr ${num(e.lr, 3)}` +
        (e.device_peak_bytes != null ? ` · peak ${bytes(e.device_peak_bytes)}` : "");
    case "started":
      return e.resumed_from_step ? `resumed from step ${e.resumed_from_step} of ${e.total_steps}` : `started, ${e.total_steps ?? "?"} steps`;
    case "checkpoint":
      return `checkpoint ${e.name || ""} at step ${e.step}`;
    case "finished":
      return `finished: ${e.status} at step ${e.step}`;
    case "failed":
      return `${e.error ? `${e.error}: ` : ""}${e.message || ""}`;
    case "log":
      return `${e.level ? `[${e.level}] ` : ""}${e.message}`;
    case "status":
      return `${e.previous ? `${e.previous} → ` : ""}${e.status || ""}${e.reason ? ` · ${e.reason}` : ""}` +
        (e.error?.message ? ` · ${e.error.message}` : "");
    case "stop_requested":
      return `${e.kind || "stop"} requested`;
    case "sample":
      return `sample at step ${e.step}${e.prompt != null ? ` · “${e.prompt}”` : ""}` +
        (e.artifact_path ? ` · ${e.artifact_path}` : e.text != null ? ` · ${e.text.slice(0, 80)}` : "");
    case "cache_progress":
      return `cached ${e.step}/${e.total_steps} · ${num(e.samples_per_s)} samples/s · text encoder ${num(e.text_encoder_s)} s · VAE ${num(e.vae_s)} s`;
    default:
      return e.message || JSON.stringify(e);
  }
}
