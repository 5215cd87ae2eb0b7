// Workers: each GPU (or the CPU worker), its memory, and the job it runs.

import { api } from "../api.js";
import { DASH, bytes, h, isNum } from "../format.js";
import { poll } from "../live.js";
import { failureBanner, progressBar } from "../widgets.js";

export async function render(root, { ctx }) {
  const banner = h("div", { class: "banner-slot" });
  const grid = h("div", { class: "worker-grid", id: "workers" }, h("div", { class: "skeleton" }, "Loading workers…"));
  root.append(h("div", { class: "page-head" }, h("h1", {}, "Workers")), banner, grid);

  return poll(async () => {
    // Workers name their job by id; the running jobs give the names to show.
    const [workers, names] = await Promise.all([api("/v1/workers").then(workerList),
      api("/v1/jobs?status=running&limit=200").then(jobNames)]);
    banner.replaceChildren();
    grid.replaceChildren(...(workers.length ? workers.map((w) => workerCard(w, names.get(w.job_id)))
      : [h("div", { class: "empty" }, h("p", { class: "empty-title" }, "No workers."), h("p", { class: "muted" }, "The service started none; check its settings."))]));
  }, { ctx, intervalMs: 3000, onError: (err) => banner.replaceChildren(failureBanner(err)) });
}

/** @param {WorkersPublic} body */
function workerList(body) {
  return body.data;
}

/**
 * Running jobs' names by id (workers name their job by id).
 * @param {JobsPublic} body
 */
function jobNames(body) {
  return new Map(body.data.map((job) => [job.id, job.name]));
}

/** @param {WorkerPublic} w */
function workerCard(w, jobName) {
  const device = w.device;
  const isCpu = !device || device === "cpu";
  const name = w.gpu_name || (isCpu ? "CPU worker" : null);
  const total = w.memory_total_bytes;
  const used = w.memory_used_bytes;
  const jobId = w.job_id;
  const state = jobId ? "busy" : "idle";
  const pct = isNum(used) && isNum(total) && total > 0 ? (100 * used) / total : null;
  return h("section", { class: "card worker", "data-worker": w.id },
    h("div", { class: "card-head" },
      h("h3", { class: "card-title" }, w.id),
      h("span", { class: `badge worker-${state}` }, state)),
    h("div", { class: "worker-gpu" }, [name, device && device !== name ? device : null].filter(Boolean).join(" · ") || DASH),
    isNum(total) ? h("div", { class: "worker-mem" }, progressBar(pct, "running"),
      h("div", { class: "small muted" }, `${bytes(used)} used of ${bytes(total)}`)) : h("div", { class: "small muted" }, isCpu ? "Runs jobs on the CPU; no GPU memory to show." : "No memory figures from this GPU."),
    h("div", { class: "worker-job" }, jobId
      ? ["Running ", h("a", { href: `#/jobs/${encodeURIComponent(jobId)}` }, jobName || jobId),
        jobName ? h("span", { class: "muted small mono" }, ` ${jobId}`) : null,
        w.pid ? h("span", { class: "muted small" }, ` · pid ${w.pid}`) : null]
      : h("span", { class: "muted" }, "Idle")));
}
