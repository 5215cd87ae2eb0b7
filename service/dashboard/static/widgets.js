// Small pieces several pages share.

import { UnreachableError } from "./api.js";
import { h, isNum } from "./format.js";

export function statusBadge(status) {
  return h("span", { class: `badge status-${status}`, "data-status": status }, status);
}

export function progressBar(pct, status = "") {
  const value = isNum(pct) ? Math.max(0, Math.min(100, pct)) : 0;
  return h("div", { class: `progress status-${status}`, role: "progressbar", "aria-valuemin": "0",
    "aria-valuemax": "100", "aria-valuenow": isNum(pct) ? value.toFixed(0) : null },
  h("div", { class: "progress-fill", style: `width:${value}%` }));
}

export function errorState(message, { title = "Something went wrong" } = {}) {
  return h("div", { class: "banner error", role: "alert" }, h("strong", {}, title), " ", message);
}

export function stat(label, value, { id, sub } = {}) {
  return h("div", { class: "stat", "data-stat": id },
    h("div", { class: "stat-label" }, label),
    h("div", { class: "stat-value" }, value),
    sub ? h("div", { class: "stat-sub muted small" }, sub) : null);
}

/** The banner for a failed poll: the server down reads differently from an error it answered. */
export function failureBanner(err) {
  if (err instanceof UnreachableError) {
    return errorState("Showing the last figures received; retrying on its own.", { title: "The Ferry service cannot be reached." });
  }
  return errorState(err?.message || String(err), { title: "The service answered with an error:" });
}
