// Number, byte, time and DOM helpers shared by the pages.

/** Build an element: h("a", {href: "#", class: "x"}, "text", child). Strings become text nodes. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "html") el.innerHTML = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export const DASH = "—";

export function isNum(value) { return typeof value === "number" && Number.isFinite(value); }

export function bytes(value) {
  if (!isNum(value)) return DASH;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = value;
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(v >= 10 ? 1 : 2)} ${units[i]}`;
}

export function num(value, digits = 4) {
  if (!isNum(value)) return DASH;
  if (value === 0) return "0";
  const abs = Math.abs(value);
  if (abs >= 1e4 || abs < 1e-3) return value.toExponential(2);
  return Number(value.toPrecision(digits)).toString();
}

export function rate(value, unit) {
  return isNum(value) ? `${num(value, 3)} ${unit}` : DASH;
}

export function duration(seconds) {
  if (!isNum(seconds) || seconds < 0) return DASH;
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  const hrs = Math.floor(m / 60);
  if (hrs < 48) return `${hrs}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(hrs / 24)}d ${hrs % 24}h`;
}

/** Seconds since an ISO timestamp or epoch number. */
export function secondsSince(when) {
  const t = toMillis(when);
  return t === null ? null : Math.max(0, (Date.now() - t) / 1000);
}

export function toMillis(when) {
  if (when === null || when === undefined || when === "") return null;
  if (isNum(when)) return when > 1e12 ? when : when * 1000;
  // Timestamps without a zone are UTC (the service stores UTC).
  const text = /[zZ]|[+-]\d\d:?\d\d$/.test(when) ? when : `${when}Z`;
  const t = Date.parse(text);
  return Number.isNaN(t) ? null : t;
}

export function age(when) {
  const s = secondsSince(when);
  return s === null ? DASH : `${duration(s)} ago`;
}

export function dateTime(when) {
  const t = toMillis(when);
  return t === null ? DASH : new Date(t).toLocaleString();
}

/**
 * A moment as the event log shows it: the reader's local clock time (``14:03:07``), the full local date and
 * time for a tooltip, and the ISO form for a <time> element. Epoch seconds, epoch milliseconds or ISO text.
 */
export function clockTime(when) {
  const t = toMillis(when);
  if (t === null) return null;
  const d = new Date(t);
  const two = (n) => String(n).padStart(2, "0");
  return { text: `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`, title: d.toLocaleString(),
    iso: d.toISOString() };
}

export function percent(value) {
  return isNum(value) ? `${value.toFixed(value >= 10 || value === 0 ? 0 : 1)}%` : DASH;
}

export function shortId(id) { return String(id ?? "").slice(0, 8); }
