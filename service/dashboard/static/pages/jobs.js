// Jobs: every job with its status, progress, loss and memory; live, filterable by status.

import { api } from "../api.js";
import { DASH, age, bytes, duration, h, isNum, num, percent, shortId } from "../format.js";
import { poll } from "../live.js";
import { STATUSES, jobsPage, ranOn } from "../model.js";
import { failureBanner, progressBar, statusBadge } from "../widgets.js";

const PAGE_SIZE = 100;

export async function render(root, { query, ctx }) {
  const status = STATUSES.includes(query.get("status")) ? query.get("status") : "";
  const filters = h("div", { class: "chips", role: "group", "aria-label": "Filter by status" },
    ["", ...STATUSES].map((s) => h("a", {
      class: `chip${s === status ? " active" : ""}`, href: s ? `#/jobs?status=${s}` : "#/jobs",
      "data-filter": s || "all", "aria-current": s === status ? "true" : null,
    }, s || "all")));
  const banner = h("div", { class: "banner-slot" });
  const list = h("div", { class: "jobs-list", id: "jobs-list" }, h("div", { class: "skeleton" }, "Loading jobs…"));
  const counter = h("span", { class: "muted count" });
  root.append(
    h("div", { class: "page-head" },
      h("div", {}, h("h1", {}, "Jobs", " ", counter)),
      h("a", { class: "btn primary", href: "#/submit" }, "New job")),
    filters, banner, list);

  async function load() {
    const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (status) params.set("status", status);
    const { jobs, more } = jobsPage(await api(`/v1/jobs?${params}`));
    banner.replaceChildren();
    counter.textContent = jobs.length ? `${jobs.length}${more ? "+" : ""}` : "";
    if (!jobs.length) { table.reset(); list.replaceChildren(emptyState(status)); return; }
    if (!list.contains(table.element)) list.replaceChildren(table.element);
    table.update(jobs, more);
  }
  const table = jobsTable();

  return poll(load, {
    ctx,
    onError: (err) => {
      banner.replaceChildren(failureBanner(err));
      if (list.querySelector(".skeleton")) list.replaceChildren();
    },
  });
}

function emptyState(status) {
  return h("div", { class: "empty", id: "jobs-empty" },
    h("p", { class: "empty-title" }, status ? `No ${status} jobs.` : "No jobs yet."),
    status ? h("a", { href: "#/jobs" }, "Show all jobs")
      : h("p", {}, "Paste a YAML spec on the ", h("a", { href: "#/submit" }, "Submit"), " page to queue your first job."));
}

// One table kept across polls: a row is rebuilt only when its job changed, so a click on a link is
// never lost to a redraw, and the age column ticks in place.
function jobsTable() {
  const head = h("thead", {}, h("tr", {},
    ["Job", "Status", "Progress", "Loss", "Peak GPU mem", "GPU", "Age"].map((c) => h("th", { scope: "col" }, c))));
  const tbody = h("tbody");
  const foot = h("p", { class: "muted small table-foot" });
  const element = h("div", { class: "card table-card" }, h("table", { class: "table jobs-table" }, head, tbody), foot);
  let rows = new Map();
  return {
    element,
    reset() { rows = new Map(); tbody.replaceChildren(); },
    update(jobs, more) {
      const next = new Map();
      for (const job of jobs) {
        const key = JSON.stringify([job.name, job.status, job.step, job.total, job.percent, job.eta && Math.round(job.eta),
          job.loss, job.peak, job.gpu, job.worker, job.error?.message]);
        const old = rows.get(job.id);
        const tr = old && old.key === key ? old.tr : jobRow(job);
        tr.querySelector("[data-col=age]").textContent = age(job.createdAt);
        next.set(job.id, { key, tr });
      }
      const order = [...next.values()].map((r) => r.tr);
      if (order.some((tr, i) => tbody.children[i] !== tr) || tbody.children.length !== order.length) {
        tbody.replaceChildren(...order);
      }
      rows = next;
      foot.textContent = more ? `Showing the latest ${jobs.length} jobs.` : "";
      foot.hidden = !more;
    },
  };
}

function jobRow(job) {
  return h("tr", { "data-job-id": job.id, "data-status": job.status, class: "job-row" },
    h("td", { class: "cell-name", "data-label": "Job" },
      h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, class: "job-link" }, job.name || shortId(job.id)),
      h("span", { class: "muted mono small" }, shortId(job.id)),
      job.status === "failed" && job.error ? h("div", { class: "row-error", title: job.error.message }, job.error.message) : null),
    h("td", { "data-label": "Status" }, statusBadge(job.status)),
    h("td", { class: "cell-progress", "data-label": "Progress" }, progressCell(job)),
    h("td", { class: "num", "data-label": "Loss", "data-col": "loss" }, num(job.loss)),
    h("td", { class: "num", "data-label": "Peak GPU mem", "data-col": "peak" },
      ranOn(job) === "CPU" ? h("span", { class: "muted" }, "CPU") : bytes(job.peak)),
    h("td", { "data-label": "GPU", "data-col": "gpu", title: job.worker ? `worker ${job.worker}` : "" },
      ranOn(job) === "CPU" ? h("span", { class: "muted" }, "CPU") : ranOn(job) || DASH),
    h("td", { class: "muted", "data-label": "Age", "data-col": "age", title: job.createdAt || "" }, age(job.createdAt)));
}

function progressCell(job) {
  const pct = isNum(job.percent) ? job.percent : job.status === "succeeded" ? 100 : null;
  const steps = isNum(job.step) && isNum(job.total) ? `${job.step}/${job.total}` : "";
  const eta = job.status === "running" && isNum(job.eta) ? `ETA ${duration(job.eta)}` : "";
  return h("div", { class: "progress-cell" },
    progressBar(pct, job.status),
    h("div", { class: "progress-text small" },
      h("span", { class: "pct" }, percent(pct)),
      steps ? h("span", { class: "muted" }, steps) : null,
      eta ? h("span", { class: "muted eta" }, eta) : null));
}
