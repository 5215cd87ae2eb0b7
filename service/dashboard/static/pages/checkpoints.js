// Checkpoints: each with its step, eval loss (the best marked), files, sizes, SHA-256 and an authenticated
// download; a LoRA checkpoint can be merged into a full model, downloaded as one archive, and a Hugging Face
// one written as a GGUF file (llama.cpp, Ollama, LM Studio). Exports made (by a button here, the API or the
// spec's export: section) are listed under their checkpoint as downloads.

import { AuthError, api, download, getToken } from "../api.js";
import { bytes, dateTime, h, isNum, num } from "../format.js";
import { checkpointExports, ggufExportable, ggufFile, mergeable, mergedArchive } from "../model.js";

export function checkpointsCard(jobId, ctx) {
  const body = h("div", { class: "checkpoints", id: "checkpoints" }, h("p", { class: "muted small" }, "Loading…"));
  const element = h("section", { class: "card" }, h("h3", { class: "card-title" }, "Checkpoints"), body);
  const base = `/v1/jobs/${encodeURIComponent(jobId)}/checkpoints`;
  let inFlight = false;

  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    try {
      const checkpoints = checkpointList(await api(base));
      body.replaceChildren(checkpoints.length ? table(checkpoints) : h("p", { class: "empty small" }, "No checkpoints yet."));
    } catch (err) {
      if (err instanceof AuthError) return ctx.needToken(err.message);
      body.replaceChildren(h("p", { class: "form-error small" }, err.message));
    } finally {
      inFlight = false;
    }
  }

  function table(checkpoints) {
    const rows = checkpoints.flatMap((ckpt) => [headRow(ckpt, mergeButton, ggufButton),
      ...ckpt.files.map((f) => fileRow(f, ctx)), ...checkpointExports(ckpt).map((f) => fileRow(f, ctx, "export"))]);
    return h("div", { class: "table-scroll" }, h("table", { class: "table compact" },
      h("thead", {}, h("tr", {}, h("th", {}, "File"), h("th", { class: "num" }, "Size"), h("th", {}, "SHA-256"))),
      h("tbody", {}, rows)));
  }

  /** Merge a LoRA checkpoint into its base model on the server, then offer the archive. */
  function mergeButton(name) {
    const slot = h("span", { class: "merge-slot" });
    const button = h("button", { class: "btn small", type: "button", "data-merge": name,
      title: "Merge the adapter into its base model (a full model, one .tar)", onclick: async () => {
        button.disabled = true;
        button.textContent = "Merging…";
        try {
          const archive = mergedArchive(await api(`${base}/${encodeURIComponent(name)}/merge`, { method: "POST" }));
          slot.replaceChildren(downloadLink(archive.url, archive.name, ctx),
            h("span", { class: "muted small" }, ` ${bytes(archive.bytes)}`));
        } catch (err) {
          if (err instanceof AuthError) return ctx.needToken(err.message);
          button.disabled = false;
          button.textContent = "Merge";
          ctx.toast(err.message, "error");
        }
      } }, "Merge");
    slot.append(button);
    return slot;
  }

  /** Write the checkpoint as an f16 GGUF file with its Modelfile on the server, then list it. */
  function ggufButton(name) {
    const button = h("button", { class: "btn small", type: "button", "data-gguf": name,
      title: "Write a GGUF file (f16) with an Ollama Modelfile; q8_0 or q4_k_m through the API or the spec's export:",
      onclick: async () => {
        button.disabled = true;
        button.textContent = "Exporting…";
        try {
          const made = ggufFile(await api(`${base}/${encodeURIComponent(name)}/gguf?quant=f16`, { method: "POST" }));
          ctx.toast(`Wrote ${made.name} (${bytes(made.bytes)})`, "info");
          await refresh();
        } catch (err) {
          if (err instanceof AuthError) return ctx.needToken(err.message);
          button.disabled = false;
          button.textContent = "GGUF";
          ctx.toast(err.message, "error");
        }
      } }, "GGUF");
    return button;
  }

  return { element, refresh };
}

/** @param {CheckpointsPublic} body */
function checkpointList(body) {
  return body.data;
}

/**
 * A checkpoint's heading row: name, step, time, eval loss, the best badge and the merge button where the
 * server says a merge works (a LoRA adapter of a family that merges; any other answers an error).
 * @param {CheckpointPublic} ckpt
 */
function headRow(ckpt, mergeButton, ggufButton) {
  const lora = mergeable(ckpt);
  return h("tr", { class: "ckpt-head", "data-checkpoint": ckpt.name },
    h("td", { colspan: "3" }, h("strong", {}, ckpt.name), h("span", { class: "muted small" },
      ` step ${ckpt.step}${ckpt.created ? ` · ${dateTime(ckpt.created)}` : ""}`,
      isNum(ckpt.eval_loss) ? ` · eval loss ${num(ckpt.eval_loss)}` : ""),
    ckpt.best ? h("span", { class: "badge best", "data-best": "true", title: "lowest eval loss" }, " best") : null,
    lora ? mergeButton(ckpt.name) : null,
    ggufExportable(ckpt) ? ggufButton(ckpt.name) : null));
}

/**
 * One file of a checkpoint, or an export made from it: an authenticated download, its size and SHA-256.
 * @param {CheckpointFile} file
 */
function fileRow(file, ctx, kind = "file") {
  return h("tr", { class: `ckpt-${kind}`, "data-kind": kind },
    h("td", {}, downloadLink(file.url, file.name, ctx), kind === "export" ? h("span", { class: "badge" }, " export") : null),
    h("td", { class: "num small" }, bytes(file.bytes)),
    h("td", { class: "sha mono small", title: file.sha256 }, h("span", { class: "sha-text" }, file.sha256)));
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
