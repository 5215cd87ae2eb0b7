// The job page's language-model cards: the eval loss chart and the samples the model generated.

import { api } from "../api.js";
import { lineChart } from "../charts.js";
import { h, isNum, num } from "../format.js";
import { normalizeSample, sampleText, samplesOf } from "../model.js";
import { gallery } from "./job-gallery.js";

/** Eval loss by step (`evalPoint`s from `/metrics`' `eval` and live `eval` events); hidden while there is none. */
export function evalChart() {
  const byStep = new Map();
  const chart = lineChart({ title: "Eval loss", xLabel: "step", yLabel: "eval loss", testId: "eval-loss",
    series: [{ label: "eval loss", color: "#e8590c" }] });
  chart.element.hidden = true;
  return {
    element: chart.element,
    add(points) {
      for (const point of points || []) {
        if (isNum(point.step) && isNum(point.evalLoss)) byStep.set(point.step, point);  // a resumed step: newer wins
      }
      const rows = [...byStep.values()].sort((a, b) => a.step - b.step);
      chart.element.hidden = rows.length === 0;
      chart.setData(rows.map((r) => r.step), rows.map((r) => r.evalLoss));
    },
    last() {
      const steps = [...byStep.keys()];
      return steps.length ? byStep.get(Math.max(...steps)) : null;
    },
  };
}

/** The samples card: each step's prompts and greedy completions, newest step first; a grpo job's completions
 * of one prompt together under it, each with its reward. */
export function samplesCard(path) {
  const seen = new Map();  // event id -> sample
  const body = h("div", { class: "samples", id: "samples" });
  const element = h("section", { class: "card", hidden: true },
    h("h3", { class: "card-title" }, "Samples"), body);

  function draw() {
    const byStep = new Map();
    for (const sample of seen.values()) {
      if (!byStep.has(sample.step)) byStep.set(sample.step, []);
      byStep.get(sample.step).push(sample);
    }
    const steps = [...byStep.keys()].sort((a, b) => b - a);
    element.hidden = steps.length === 0;
    body.replaceChildren(...steps.map((step) => {
      const images = byStep.get(step).filter((s) => s.url);
      return h("div", { class: "sample-step", "data-step": String(step) },
        h("div", { class: "muted small" }, `step ${step}`),
        images.length ? gallery(images) : null,
        ...textSamples(byStep.get(step).filter((s) => !s.url)));
    }));
  }

  return {
    element,
    /** Samples as `normalizeSample` makes them (a stored one, or a streamed event with its stream id). */
    add(samples) {
      for (const sample of samples) seen.set(sample.key, sample);
      draw();
    },
    async load() {
      this.add(samplesOf(await api(`${path}/samples?limit=1000`)).map((sample) => normalizeSample(sample, path)));
    },
  };
}

/** Text samples as blocks: one per prompt and completion, or, where they carry rewards (grpo), one per prompt
 * with its completions and their rewards. */
function textSamples(samples) {
  if (!samples.some((s) => isNum(s.reward))) {
    return samples.map((s) => h("div", { class: "sample" },
      h("div", { class: "sample-prompt" }, h("strong", {}, s.prompt ?? "")), sampleBody(s.text)));
  }
  const byPrompt = new Map();
  for (const sample of samples) {
    const prompt = sample.prompt ?? "";
    if (!byPrompt.has(prompt)) byPrompt.set(prompt, []);
    byPrompt.get(prompt).push(sample);
  }
  return [...byPrompt.entries()].map(([prompt, group]) => h("div", { class: "sample sample-group" },
    h("div", { class: "sample-prompt" }, h("strong", {}, prompt),
      h("span", { class: "muted small" }, ` · ${group.length} completions, mean reward ${num(mean(group.map((s) => s.reward)), 3)}`)),
    ...group.map((s) => h("div", { class: "sample-completion" },
      h("span", { class: "sample-reward mono small", "data-reward": String(s.reward) }, `reward ${num(s.reward, 3)}`),
      sampleBody(s.text)))));
}

function mean(values) {
  const nums = values.filter(isNum);
  return nums.length ? nums.reduce((a, b) => a + b, 0) / nums.length : null;
}

/** A sample's text in a bounded block; whitespace only is said in words, not drawn as empty lines. */
function sampleBody(text) {
  const shown = sampleText(text);
  return h("pre", { class: `sample-text${shown.blank ? " sample-blank muted" : ""}` }, shown.text);
}

/** The last evaluation in a line (an `evalPoint`). */
export function evalStat(point) {
  if (!point) return null;
  const other = point.perplexity != null ? `ppl ${num(point.perplexity, 3)}` : `reward accuracy ${num(point.rewardAccuracy, 3)}`;
  return `${num(point.evalLoss)} (${other})`;
}
