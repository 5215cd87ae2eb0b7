// Submit: paste or upload a YAML spec, check it (every problem next to its line, and the fit
// estimate), then queue it and open its page.

import { AuthError, ApiError, api } from "../api.js";
import { bytes, h } from "../format.js";
import { describeError } from "../live.js";
import { estimateOf, normalizeJob, problemsOf } from "../model.js";
import { errorState } from "../widgets.js";

const DRAFT_KEY = "ferry.draft";

export async function render(root, { ctx }) {
  const textarea = h("textarea", { id: "spec-input", spellcheck: "false", autocapitalize: "off", autocomplete: "off",
    "aria-label": "Job spec (YAML)", placeholder: "# Paste a job spec here, or upload a .yaml file" });
  textarea.value = sessionStorage.getItem(DRAFT_KEY) || "";
  const gutter = h("div", { class: "gutter", "aria-hidden": "true" });
  const editor = h("div", { class: "editor" }, gutter, textarea);
  const file = h("input", { type: "file", accept: ".yaml,.yml,text/yaml,application/yaml", id: "spec-file", class: "visually-hidden" });
  const validateBtn = h("button", { class: "btn", type: "button", id: "validate" }, "Validate");
  const submitBtn = h("button", { class: "btn primary", type: "button", id: "submit" }, "Submit job");
  const results = h("div", { class: "results", id: "results" });
  let problemLines = new Map();

  root.append(
    h("div", { class: "page-head" }, h("h1", {}, "Submit a job")),
    h("div", { class: "submit-grid" },
      h("section", { class: "card editor-card" },
        h("div", { class: "card-head" },
          h("h3", { class: "card-title" }, "Spec (YAML)"),
          h("label", { class: "link-button small", for: "spec-file" }, "Upload .yaml…"), file),
        editor,
        h("div", { class: "row actions" }, validateBtn, submitBtn,
          h("span", { class: "muted small" }, "Validate checks the spec and estimates memory without queueing."))),
      results));

  function drawGutter() {
    const n = textarea.value.split("\n").length;
    gutter.replaceChildren(...Array.from({ length: n }, (_, i) => {
      const messages = problemLines.get(i + 1);
      return h("div", { class: messages ? "ln bad" : "ln", title: messages ? messages.join("\n") : null }, String(i + 1));
    }));
    gutter.scrollTop = textarea.scrollTop;
  }

  textarea.addEventListener("input", () => {
    sessionStorage.setItem(DRAFT_KEY, textarea.value);
    problemLines = new Map();
    drawGutter();
  });
  textarea.addEventListener("scroll", () => { gutter.scrollTop = textarea.scrollTop; });
  textarea.addEventListener("keydown", (e) => {
    if (e.key === "Tab") { e.preventDefault(); textarea.setRangeText("  ", textarea.selectionStart, textarea.selectionEnd, "end"); }
  });
  file.addEventListener("change", async () => {
    const chosen = file.files?.[0];
    if (!chosen) return;
    textarea.value = await chosen.text();
    textarea.dispatchEvent(new Event("input"));
    results.replaceChildren(h("p", { class: "muted small" }, `Loaded ${chosen.name}.`));
  });
  editor.addEventListener("dragover", (e) => e.preventDefault());
  editor.addEventListener("drop", async (e) => {
    e.preventDefault();
    const dropped = e.dataTransfer?.files?.[0];
    if (dropped) { textarea.value = await dropped.text(); textarea.dispatchEvent(new Event("input")); }
  });

  // `request(options)` posts the spec and reads the answer with the reader of its schema; a refusal is read
  // by `problemsOf`.
  async function send(busyButton, request) {
    if (!textarea.value.trim()) {
      results.replaceChildren(errorState("Paste or upload a YAML spec first.", { title: "Nothing to check." }));
      return null;
    }
    busyButton.disabled = true;
    busyButton.classList.add("busy");
    try {
      const answer = await request({ method: "POST", body: textarea.value, contentType: "application/yaml" });
      return { ok: true, answer, problems: [] };
    } catch (err) {
      if (err instanceof AuthError) { ctx.needToken(err.message); return null; }
      if (err instanceof ApiError && (err.status === 422 || err.status === 400)) return { ok: false, problems: problemsOf(err.body), message: err.message };
      results.replaceChildren(errorState(describeError(err), { title: "The request failed." }));
      return null;
    } finally {
      busyButton.disabled = false;
      busyButton.classList.remove("busy");
    }
  }

  function showProblems(problems, estimate, heading) {
    problemLines = new Map();
    for (const p of problems) {
      if (p.line === null) continue;
      problemLines.set(p.line, [...(problemLines.get(p.line) || []), p.message]);
    }
    drawGutter();
    results.replaceChildren(...[
      problems.length ? problemsCard(problems, textarea, heading) : okCard(),
      estimate?.present ? estimateCard(estimate) : null,
    ].filter(Boolean));
  }

  validateBtn.addEventListener("click", async () => {
    const answer = await send(validateBtn, (options) => api("/v1/jobs/validate", options).then(estimateOf));
    if (!answer) return;
    if (!answer.ok && !answer.problems.length) {
      results.replaceChildren(errorState(answer.message, { title: "The spec was refused." }));
      return;
    }
    showProblems(answer.problems, answer.ok ? answer.answer : null, "The spec has problems");
  });

  submitBtn.addEventListener("click", async () => {
    const answer = await send(submitBtn, (options) => api("/v1/jobs", options).then(normalizeJob));
    if (!answer) return;
    if (!answer.ok) {
      if (answer.problems.length) showProblems(answer.problems, null, "Not queued: the spec has problems");
      else results.replaceChildren(errorState(answer.message, { title: "Not queued." }));
      return;
    }
    const job = answer.answer;
    sessionStorage.removeItem(DRAFT_KEY);
    ctx.toast(`Queued ${job.name || job.id}.`, "ok");
    ctx.navigate(`#/jobs/${encodeURIComponent(job.id)}`);
  });

  drawGutter();
  return () => {};
}

function okCard() {
  return h("section", { class: "card ok-card", id: "valid" }, h("h3", { class: "card-title" }, "✓ The spec is valid"));
}

function problemsCard(problems, textarea, heading) {
  const lines = textarea.value.split("\n");
  const byLine = new Map();
  const unplaced = [];
  for (const p of problems) {
    if (p.line !== null && p.line >= 1 && p.line <= lines.length) byLine.set(p.line, [...(byLine.get(p.line) || []), p]);
    else unplaced.push(p);
  }
  const message = (p) => h("div", { class: "problem", "data-line": p.line ?? "", "data-path": p.path },
    h("span", { class: "problem-where" }, p.line ? `line ${p.line}` : "spec", p.path ? ` · ${p.path}` : ""),
    h("span", { class: "problem-text" }, p.message),
    p.suggestion ? h("span", { class: "problem-hint" }, "Did you mean ", h("code", {}, p.suggestion), "?") : null);
  const listing = [];
  lines.forEach((text, i) => {
    const lineNo = i + 1;
    const here = byLine.get(lineNo);
    // Show each bad line with two lines of context either side.
    const near = [...byLine.keys()].some((l) => Math.abs(l - lineNo) <= 2);
    if (!near) return;
    if (listing.length && listing[listing.length - 1].dataset.line !== String(lineNo - 1)) {
      listing.push(h("div", { class: "src-gap", "data-line": "" }, "⋯"));
    }
    listing.push(h("div", { class: here ? "src bad" : "src", "data-line": String(lineNo),
      onclick: () => selectLine(textarea, lineNo) },
    h("span", { class: "src-no" }, String(lineNo)), h("code", { class: "src-text" }, text || " ")));
    if (here) listing.push(...here.map(message));
  });
  return h("section", { class: "card problems-card", id: "problems", role: "alert" },
    h("h3", { class: "card-title" }, `${heading} (${problems.length})`),
    unplaced.length ? h("div", { class: "unplaced" }, unplaced.map(message)) : null,
    listing.length ? h("div", { class: "annotated" }, listing) : null);
}

function selectLine(textarea, lineNo) {
  const lines = textarea.value.split("\n");
  const start = lines.slice(0, lineNo - 1).reduce((n, l) => n + l.length + 1, 0);
  textarea.focus();
  textarea.setSelectionRange(start, start + lines[lineNo - 1].length);
}

function estimateCard(e) {
  const verdict = e.fits === true ? "Fits" : e.fits === false ? "Does not fit" : "Fit unknown";
  return h("section", { class: `card estimate ${e.fits === false ? "no-fit" : e.fits ? "fit" : ""}`, id: "estimate" },
    h("h3", { class: "card-title" }, "Memory estimate"),
    h("div", { class: "verdict", "data-fits": String(e.fits) }, verdict),
    h("dl", { class: "kv" },
      h("dt", {}, "Peak GPU memory"), h("dd", {}, bytes(e.peak)),
      h("dt", {}, "Pinned host memory"), h("dd", {}, bytes(e.pinned)),
      e.hostAvailable ? [h("dt", {}, "Host memory available"), h("dd", {}, bytes(e.hostAvailable))] : null),
    e.devices?.length ? h("table", { class: "table compact devices" },
      h("thead", {}, h("tr", {}, h("th", {}, "Worker"), h("th", {}, "Device"), h("th", { class: "num" }, "Memory"), h("th", {}, "Fits"))),
      h("tbody", {}, e.devices.map(deviceRow))) : null,
    e.reason ? h("p", { class: "small" }, e.reason) : null,
    e.notes?.length ? h("ul", { class: "notes small muted" }, e.notes.map((n) => h("li", {}, n))) : null);
}

/** @param {DeviceFit} d */
function deviceRow(d) {
  return h("tr", {},
    h("td", {}, d.worker), h("td", {}, d.device ?? "cpu"),
    h("td", { class: "num" }, bytes(d.memory_total_bytes)),
    h("td", { class: d.fits === false ? "form-error" : "" }, d.fits === true ? "yes" : d.fits === false ? "no" : "—"));
}
