"""The samples card of an image-text job, drawn by job-llm.js in node over a minimal DOM: a text sample whose
prompt showed an image is drawn as a figure with the image (an ``<img>`` whose source is the sample's URL), the
prompt and the model's answer; a text sample without an image keeps its text block."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from jobs.events import SampleEvent
from service.api.schemas import SamplePoint, SamplesPublic
from service.dashboard.mount import STATIC_DIR

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (CI installs it)")

# Just what h() and the card use of the DOM; serialize() writes the tree as HTML, an <img>'s src included.
DOM = """
class Node { constructor() { this.childNodes = []; this.attributes = {}; }
  append(...c) { this.childNodes.push(...c); } replaceChildren(...c) { this.childNodes = c; }
  setAttribute(k, v) { this.attributes[k] = String(v); } addEventListener() {} }
class Element extends Node { constructor(tag) { super(); this.tagName = tag; this.dataset = {}; this.className = ""; } }
class Text extends Node { constructor(t) { super(); this.text = t; } }
globalThis.Node = Node;
globalThis.document = { createElement: (t) => new Element(t), createTextNode: (t) => new Text(t) };
globalThis.sessionStorage = { getItem: () => null, setItem() {}, removeItem() {} };
function serialize(n) {
  if (n instanceof Text) return n.text;
  const a = { ...n.attributes };
  if (n.className) a.class = n.className;
  if (n.src) a.src = n.src;
  const attrs = Object.entries(a).map(([k, v]) => ` ${k}="${v}"`).join("");
  return `<${n.tagName}${attrs}>${n.childNodes.map(serialize).join("")}</${n.tagName}>`;
}
"""


def draw_samples(page: SamplesPublic, streamed: list[dict[str, object]]) -> str:
    """The samples card's HTML after it is given ``page`` (GET /samples) and ``streamed`` sample events."""
    script = DOM + (
        f"const {{ samplesCard }} = await import({json.dumps((STATIC_DIR / 'pages' / 'job-llm.js').as_uri())});\n"
        f"const m = await import({json.dumps((STATIC_DIR / 'model.js').as_uri())});\n"
        "const card = samplesCard('/v1/jobs/j');\n"
        f"card.add(m.samplesOf({page.model_dump_json()}).map((s) => m.normalizeSample(s, '/v1/jobs/j')));\n"
        f"card.add({json.dumps(streamed)}.map((e, i) => m.normalizeSample(e, '/v1/jobs/j', String(100 + i))));\n"
        "console.log(serialize(card.element));\n"
    )
    done = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, check=True)
    return done.stdout


def test_a_text_sample_with_its_prompts_image_is_drawn_with_the_image_the_prompt_and_the_answer() -> None:
    thumbnail = "samples/prompts/prompt-0.png"  # what an image-text job's text sample names (samples.py)
    listed = SamplePoint(
        step=1,
        prompt="[red.png] what colour is this image",
        text="red",
        artifact_path=thumbnail,
        media_type="image/png",
        event_id=7,
        time=1.0,
        url=f"/v1/jobs/j/samples/files/{thumbnail}",
    )
    plain = SamplePoint(step=1, prompt="hello", text="world", event_id=8, time=1.0)
    streamed = SampleEvent(step=2, prompt="[red.png] what colour is this image", text="blue",
                           artifact_path=thumbnail, media_type="image/png")  # fmt: skip
    html = draw_samples(
        SamplesPublic(data=[listed, plain], next_cursor=8, has_more=False),
        [streamed.model_dump(mode="json", exclude_none=True)],
    )
    figures = re.findall(r'<figure class="sample-figure">.*?</figure>', html)
    assert len(figures) == 2, html  # one a step, newest first
    src = f'src="/v1/jobs/j/samples/files/{thumbnail}"'
    for figure, answer in zip(figures, ["blue", "red"], strict=True):
        assert "<img" in figure and src in figure, figure
        assert '<figcaption class="small">[red.png] what colour is this image</figcaption>' in figure
        assert f'<div class="sample-answer">{answer}</div>' in figure
    assert '<pre class="sample-text">world</pre>' in html and html.count("<img") == 2  # the text sample: no image
