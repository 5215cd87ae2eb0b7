// The spec as submitted: the YAML text when the service kept it, else the parsed spec.

import { h } from "../format.js";

export function specCard(job) {
  const text = job.specText || (job.spec ? toYaml(job.spec) : "");
  const pre = h("pre", { class: "code spec", id: "job-spec" }, text || "The service did not return the spec.");
  const copy = h("button", { class: "link-button small", type: "button",
    onclick: () => navigator.clipboard?.writeText(text).then(() => { copy.textContent = "copied"; }) }, "copy");
  return h("section", { class: "card" },
    h("div", { class: "card-head" }, h("h3", { class: "card-title" }, job.specText ? "Spec as submitted" : "Spec"), copy), pre);
}

/** A readable YAML-like rendering of the parsed spec (only for display). */
function toYaml(value, indent = "") {
  if (value === null || typeof value !== "object") return JSON.stringify(value);
  const lines = [];
  const entries = Array.isArray(value) ? value.map((v) => ["-", v]) : Object.entries(value);
  for (const [key, v] of entries) {
    const label = Array.isArray(value) ? "-" : `${key}:`;
    if (v !== null && typeof v === "object" && Object.keys(v).length) lines.push(`${indent}${label}\n${toYaml(v, `${indent}  `)}`);
    else lines.push(`${indent}${label} ${v !== null && typeof v === "object" ? (Array.isArray(v) ? "[]" : "{}") : JSON.stringify(v)}`);
  }
  return lines.join("\n");
}
