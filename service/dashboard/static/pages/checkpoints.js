// Checkpoints: each with its step, files, sizes, SHA-256 and an authenticated download.

import { AuthError, api, download, getToken } from "../api.js";
import { bytes, dateTime, h } from "../format.js";
import { listOf } from "../model.js";

export function checkpointsCard(jobId, ctx) {
  const body = h("div", { class: "checkpoints", id: "checkpoints" }, h("p", { class: "muted small" }, "Loading…"));
  const element = h("section", { class: "card" }, h("h3", { class: "card-title" }, "Checkpoints"), body);
  const base = `/v1/jobs/${encodeURIComponent(jobId)}/checkpoints`;
  let inFlight = false;

  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    try {
      const checkpoints = listOf(await api(base), "checkpoints");
      body.replaceChildren(checkpoints.length ? table(checkpoints) : h("p", { class: "empty small" }, "No checkpoints yet."));
    } catch (err) {
      if (err instanceof AuthError) return ctx.needToken(err.message);
      body.replaceChildren(h("p", { class: "form-error small" }, err.message));
    } finally {
      inFlight = false;
    }
  }

  function table(checkpoints) {
    const rows = [];
    for (const ckpt of checkpoints) {
      const name = ckpt.name || ckpt.id;
      const files = ckpt.files || [];
      rows.push(h("tr", { class: "ckpt-head", "data-checkpoint": name },
        h("td", { colspan: "3" }, h("strong", {}, name), h("span", { class: "muted small" },
          ` step ${ckpt.step ?? "?"}${ckpt.created || ckpt.created_at ? ` · ${dateTime(ckpt.created || ckpt.created_at)}` : ""}`))));
      for (const file of files) {
        const url = file.url || `${base}/${encodeURIComponent(name)}/files/${encodeURIComponent(file.name)}`;
        rows.push(h("tr", { class: "ckpt-file" },
          h("td", {}, downloadLink(url, file.name, ctx)),
          h("td", { class: "num small" }, bytes(file.bytes ?? file.size)),
          h("td", { class: "sha mono small", title: file.sha256 || "" },
            file.sha256 ? h("span", { class: "sha-text" }, file.sha256) : "—")));
      }
    }
    return h("div", { class: "table-scroll" }, h("table", { class: "table compact" },
      h("thead", {}, h("tr", {}, h("th", {}, "File"), h("th", { class: "num" }, "Size"), h("th", {}, "SHA-256"))),
      h("tbody", {}, rows)));
  }

  return { element, refresh };
}

/**
 * A plain link the browser downloads natively (streamed to disk, resumable). With a token, a click
 * fetches the file with the Authorization header instead: the token never goes into a URL.
 */
function downloadLink(url, name, ctx) {
  return h("a", { class: "download", href: url, download: name, "data-file": name, title: `Download ${name}`,
    onclick: (event) => {
      if (!getToken()) return;
      event.preventDefault();
      download(url, name).catch((err) => ctx.toast(err.message, "error"));
    } }, `⤓ ${name}`);
}
