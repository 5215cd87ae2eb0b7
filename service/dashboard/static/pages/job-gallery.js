// A sample that is an image (a diffusion job's): shown in the samples card's per-step gallery, so a user
// sees a LoRA take hold step by step. Images load with the token in a header, never in the URL.

import { blobUrl, getToken } from "../api.js";
import { h } from "../format.js";

/** A figure for one image sample (a `normalizeSample`): the picture (click: full size) and its prompt. */
export function sampleImage(sample) {
  const img = h("img", { class: "sample-image", alt: sample.prompt ?? "sample", loading: "lazy",
    "data-sample": sample.artifactPath || "" });
  const link = h("a", { href: sample.url, target: "_blank", rel: "noopener" }, img);
  if (getToken()) {
    blobUrl(sample.url).then((url) => { img.src = url; link.href = url; })
      .catch((err) => { img.alt = `${sample.prompt ?? "sample"} (${err.message})`; });
  } else {
    img.src = sample.url;
  }
  // An image-text model's sample carries the model's answer to the image beside its prompt.
  const answer = sample.text != null ? h("div", { class: "sample-answer" }, sample.text) : null;
  return h("figure", { class: "sample-figure" }, link, h("figcaption", { class: "small" }, sample.prompt ?? ""), answer);
}

/** The images of one step side by side; the text samples keep their own layout. */
export function gallery(samples) {
  return h("div", { class: "sample-gallery" }, ...samples.map(sampleImage));
}
