"""A grpo job on the dashboard: its step figures read from the API's own answer, its charts (reward, KL,
completion length, clip fraction, generation and training tokens/s) and its samples (a prompt's completions
with their rewards) drawn by the page's own modules in node over a small DOM stand-in; none of it on an sft job.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest

from jobs.events import GRPOMetrics, SampleEvent, StepEvent
from service.api.schemas import MetricPoint
from service.dashboard.mount import STATIC_DIR
from tests.service.dashboard.test_dashboard_readers import read_with

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (CI installs it)")

# Enough of the DOM for h(), the chart cards and the samples card: elements with attributes, children, text.
DOM = r"""
class Node {
  constructor(tag) { this.tag = tag; this.children = []; this.attributes = {}; this.dataset = {}; this.hidden = false;
    this.className = ""; const el = this;
    this.classList = { toggle(name, on) { const set = new Set(el.className.split(" ").filter(Boolean));
      (on ?? !set.has(name)) ? set.add(name) : set.delete(name); el.className = [...set].join(" "); } }; }
  set hidden(value) { this._hidden = Boolean(value); }
  get hidden() { return this._hidden; }
  append(...nodes) { this.children.push(...nodes); }
  replaceChildren(...nodes) { this.children = nodes; }
  setAttribute(key, value) {
    this.attributes[key] = String(value);
    if (key === "hidden") this.hidden = true;
    if (key.startsWith("data-")) this.dataset[key.slice(5).replace(/-(\w)/g, (_, c) => c.toUpperCase())] = String(value);
  }
  addEventListener() {}
  closest() { return null; }
  get textContent() { return this.text ?? this.children.map((c) => c.textContent).join(""); }
  all(test) { return [...(test(this) ? [this] : []), ...this.children.flatMap((c) => c.all(test))]; }
}
class Text extends Node { constructor(text) { super("#text"); this.text = text; } }
globalThis.Node = Node;
globalThis.document = { createElement: (tag) => new Node(tag), createTextNode: (text) => new Text(text),
  head: new Node("head"), body: new Node("body") };
globalThis.requestAnimationFrame = (f) => f();
"""


def render(script: str, **data: Any) -> Any:
    """Run ``script`` in node after the DOM stand-in, with the page modules as ``series`` and ``llm`` and
    ``data`` as ``a``; it prints its answer as JSON."""
    module = (
        DOM
        + f"const series = await import({json.dumps((STATIC_DIR / 'pages' / 'job-series.js').as_uri())});\n"
        + f"const llm = await import({json.dumps((STATIC_DIR / 'pages' / 'job-llm.js').as_uri())});\n"
        + f"const a = {json.dumps(data)};\n"
        + script
    )
    done = subprocess.run(["node", "--input-type=module", "-e", module], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_point(step: int, grpo: GRPOMetrics | None) -> dict[str, Any]:
    """A `/metrics` point as the API sends it: a real step event with its id and time."""
    event = StepEvent(
        step=step, total_steps=3, loss=0.1, lr=1e-5, samples_per_s=2.0, elapsed_s=float(step), eta_s=1.0, grpo=grpo
    )
    return MetricPoint(**event.model_dump(), event_id=step, time=float(step)).model_dump(mode="json")


def figures(step: int, kl: float | None = 0.01) -> GRPOMetrics:
    return GRPOMetrics(
        reward_mean=0.25 * step,
        reward_std=0.5,
        frac_reward_zero_std=0.0,
        completion_length=10.0 + step,
        clip_ratio=0.02,
        kl=kl,
        generated_tokens=80,
        generation_s=2.0,
        generation_tokens_per_s=40.0,
        training_s=0.5,
        training_tokens_per_s=400.0 * step,
    )


def test_a_grpo_step_is_read_with_its_figures_and_an_sft_step_without() -> None:
    read = read_with(
        "[m.flattenStep(a.grpo), m.flattenStep(a.sft), m.hasGrpo([m.flattenStep(a.sft)])]",
        grpo=step_point(2, figures(2)),
        sft=step_point(1, None),
    )
    grpo, sft, sft_has = read
    assert {k: grpo[k] for k in ("reward", "rewardStd", "kl", "completionLength", "clipRatio")} == {
        "reward": 0.5,
        "rewardStd": 0.5,
        "kl": 0.01,
        "completionLength": 12.0,
        "clipRatio": 0.02,
    }
    assert (grpo["generationTokensPerS"], grpo["trainingTokensPerS"]) == (40.0, 800.0)
    assert sft["reward"] is None and sft["generationTokensPerS"] is None and sft_has is False


CHARTS = ["reward", "kl", "completion-length", "clip-fraction", "grpo-tokens"]
DRAW_CHARTS = """
const store = series.seriesStore();
store.addRows(a.rows);
const charts = series.makeCharts({ cpu: true });
charts.update(store);
const shown = Object.fromEntries(charts.all.map((c) => [c.element.dataset.chart,
  c.element.hidden ? null : Number(c.element.dataset.points)]));
console.log(JSON.stringify(shown));
"""


def test_a_grpo_job_charts_reward_kl_length_clipping_and_both_throughputs() -> None:
    shown = render(DRAW_CHARTS, rows=[step_point(s, figures(s)) for s in (1, 2, 3)])
    assert {name: shown[name] for name in CHARTS} == dict.fromkeys(CHARTS, 3)  # every chart, a point a step
    assert shown["loss"] == 3


def test_an_sft_job_has_no_grpo_charts_and_beta_zero_no_kl_chart() -> None:
    sft = render(DRAW_CHARTS, rows=[step_point(s, None) for s in (1, 2)])
    assert {name: sft[name] for name in CHARTS} == dict.fromkeys(CHARTS)  # hidden
    no_kl = render(DRAW_CHARTS, rows=[step_point(s, figures(s, kl=None)) for s in (1, 2)])
    assert no_kl["kl"] is None and no_kl["reward"] == 2


def test_grpo_samples_show_each_prompt_once_with_its_completions_and_rewards() -> None:
    samples = [
        SampleEvent(step=4, prompt="what is 2 plus 2?", text=text, reward=reward).model_dump(mode="json")
        for text, reward in [("4", 1.0), ("five", 0.0), ("4!", 1.0)]
    ]
    samples.append(SampleEvent(step=4, prompt="say hi", text="hi", reward=1.0).model_dump(mode="json"))
    script = """
const card = llm.samplesCard("/v1/jobs/j");
card.add(a.samples.map((s, i) => ({ ...s, key: String(i), url: null })));
const groups = card.element.all((n) => (n.className || "").split(" ").includes("sample-group"));
console.log(JSON.stringify({ hidden: card.element.hidden, groups: groups.map((g) => ({
  prompt: g.children[0].children[0].textContent, head: g.children[0].textContent,
  completions: g.all((n) => n.className === "sample-completion").map((c) => [c.children[0].textContent,
    c.children[1].textContent]) })) }));
"""
    read = render(script, samples=samples)
    assert read["hidden"] is False
    first, second = read["groups"]
    assert first["prompt"] == "what is 2 plus 2?" and "3 completions, mean reward 0.667" in first["head"]
    assert first["completions"] == [["reward 1", "4"], ["reward 0", "five"], ["reward 1", "4!"]]
    assert second["prompt"] == "say hi" and second["completions"] == [["reward 1", "hi"]]


def test_samples_without_rewards_are_drawn_one_by_one_as_before() -> None:
    samples = [SampleEvent(step=1, prompt="hello", text=" world").model_dump(mode="json")]
    script = """
const card = llm.samplesCard("/v1/jobs/j");
card.add(a.samples.map((s, i) => ({ ...s, key: String(i), url: null })));
console.log(JSON.stringify({ groups: card.element.all((n) => (n.className || "").includes("sample-group")).length,
  samples: card.element.all((n) => n.className === "sample").map((n) => n.textContent) }));
"""
    assert render(script, samples=samples) == {"groups": 0, "samples": ["hello world"]}
