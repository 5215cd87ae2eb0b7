// Workers: each GPU (or the CPU worker), its memory, and the job it runs.

import { api } from "../api.js";
import { DASH, bytes, h, isNum } from "../format.js";
import { poll } from "../live.js";
import { listOf, pick } from "../model.js";
import { failureBanner, progressBar } from "../widgets.js";

export async function render(root, { ctx }) {
  const banner = h("div", { class: "banner-slot" });
  const grid = h("div", { class: "worker-grid", id: "workers" }, h("div", { class: "skeleton" }, "Loading workers…"));
  root.append(h("div", { class: "page-head" }, h("h1", {}, "Workers")), banner, grid);

  return poll(async () => {
    // Workers name their job by id; the running jobs give the names to show.
    const [workersBody, runningBody] = await Promise.all([api("/v1/workers"), api("/v1/jobs?status=running&limit=200")]);
    const names = new Map(listOf(runningBody).map((job) => [String(job.id), job.name]));
    const workers = listOf(workersBody, "workers").map((w) => ({ ...w, job_name: w.job_name ?? names.get(String(w.job_id)) }));
    banner.replaceChildren();
    grid.replaceChildren(...(workers.length ? workers.map(workerCard)
      : [h("div", { class: "empty" }, h("p", { class: "empty-title" }, "No workers."), h("p", { class: "muted" }, "The service started none; check its settings."))]));
  }, { ctx, intervalMs: 3000, onError: (err) => banner.replaceChildren(failureBanner(err)) });
}

function workerCard(w) {
  const gpu = pick(w, "gpu") || {};
  const device = pick(w, "device", "gpu.device");
  const isCpu = !device || device === "cpu";
  const name = pick(w, "gpu.name", "gpu_name", "device_name") || (isCpu ? "CPU worker" : null);
  const index = pick(w, "gpu.index", "gpu_index", "index");
  const total = pick(w, "gpu.total_bytes", "gpu.memory_total_bytes", "memory_total_bytes", "total_bytes");
  const used = pick(w, "gpu.used_bytes", "gpu.memory_used_bytes", "memory_used_bytes", "used_bytes", "gpu.allocated_bytes");
  const jobId = pick(w, "job_id", "job.id", "current_job_id", "running_job_id");
  const jobName = pick(w, "job.name", "job_name");
  const state = pick(w, "status", "state") || (jobId ? "busy" : "idle");
  const pct = isNum(used) && isNum(total) && total > 0 ? (100 * used) / total : null;
  return h("section", { class: "card worker", "data-worker": pick(w, "id", "name") ?? "" },
    h("div", { class: "card-head" },
      h("h3", { class: "card-title" }, String(pick(w, "name", "id") ?? "worker")),
      h("span", { class: `badge worker-${state}` }, state)),
    h("div", { class: "worker-gpu" }, [name, device && device !== name ? device : null, isNum(index) ? `#${index}` : null]
      .filter(Boolean).join(" · ") || (typeof gpu === "string" ? gpu : DASH)),
    isNum(total) ? h("div", { class: "worker-mem" }, progressBar(pct, "running"),
      h("div", { class: "small muted" }, `${bytes(used)} used of ${bytes(total)}`)) : h("div", { class: "small muted" }, isCpu ? "Runs jobs on the CPU; no GPU memory to show." : "No memory figures from this GPU."),
    h("div", { class: "worker-job" }, jobId
      ? ["Running ", h("a", { href: `#/jobs/${encodeURIComponent(jobId)}` }, jobName || jobId),
        jobName ? h("span", { class: "muted small mono" }, ` ${jobId}`) : null,
        pick(w, "pid") ? h("span", { class: "muted small" }, ` · pid ${pick(w, "pid")}`) : null]
      : h("span", { class: "muted" }, "Idle")));
}
