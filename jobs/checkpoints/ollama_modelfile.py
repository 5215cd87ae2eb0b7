"""An Ollama ``Modelfile`` beside an exported GGUF: ``ollama create NAME -f step-00000100-q8_0.Modelfile``.

Ollama formats a chat with a Go template, not the Jinja chat template the tokenizer carries. The Jinja
template is rendered here on probe conversations and compared with the turn formats Ferry can write as Go
templates (ChatML, Llama 3); on a match the Modelfile gets that ``TEMPLATE``, the template's default system
prompt as ``SYSTEM``, and a ``PARAMETER stop`` for each end-of-turn and end-of-text token, so generation stops
where the model was trained to stop. A template that matches none is left out (with a comment saying so):
Ollama then chooses one from the ``tokenizer.chat_template`` stored in the GGUF.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TurnFormat:
    """A chat format whose every turn is ``prefix(role) + content + end``, then the assistant's prefix.

    Attributes:
        name: What the Modelfile's comment calls it.
        prefix: A turn's opening text, ``{role}`` standing for the role.
        end: A turn's closing text.
        stops: The texts that end an assistant turn (Ollama's ``PARAMETER stop``).
    """

    name: str
    prefix: str
    end: str
    stops: tuple[str, ...]

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt this format makes of ``messages``, ready for the assistant's reply."""
        turns = "".join(self.prefix.format(role=m["role"]) + m["content"] + self.end for m in messages)
        return turns + self.prefix.format(role="assistant")

    def ollama_template(self) -> str:
        """The same format as an Ollama Go template over ``.Messages`` (system messages included)."""
        prefix = self.prefix.format(role="{{ .Role }}")
        return "{{- range .Messages }}" + prefix + "{{ .Content }}" + self.end + "{{ end }}" + self.render([])


CHATML = TurnFormat("ChatML", "<|im_start|>{role}\n", "<|im_end|>\n", ("<|im_end|>",))
LLAMA3 = TurnFormat("Llama 3", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>", ("<|eot_id|>",))
FORMATS = (CHATML, LLAMA3)

_PROBE = [
    {"role": "system", "content": "SYSTEM-PROBE"},
    {"role": "user", "content": "USER-PROBE-1"},
    {"role": "assistant", "content": "ASSISTANT-PROBE"},
    {"role": "user", "content": "USER-PROBE-2"},
]


@dataclass(frozen=True)
class ChatMapping:
    """The Ollama side of a chat template: the format it matched (None: none), its default system prompt,
    and text the template writes before the first turn (a BOS the tokenizer does not add itself)."""

    format: TurnFormat | None
    default_system: str | None
    lead: str = ""

    def ollama_template(self) -> str:
        assert self.format is not None
        return self.lead + self.format.ollama_template()


def map_chat_template(tokenizer: Any) -> ChatMapping:
    """Which :data:`FORMATS` entry the tokenizer's chat template renders exactly, and its default system prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return ChatMapping(None, None)
    try:
        full = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
        lone = tokenizer.apply_chat_template(_PROBE[1:2], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that fails on plain turns (tool-only, strict role checks): no mapping
        return ChatMapping(None, None)
    bos = tokenizer.bos_token
    # A template that writes BOS as text (Llama 3's {{ bos_token }}): llama.cpp adds BOS itself where the
    # tokenizer does (the GGUF's add_bos_token), so the Go template leaves it out there, and writes it else.
    adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
    readings = [("", full, lone)]
    if bos and full.startswith(bos) and lone.startswith(bos):
        readings.append(("" if adds_bos else bos, full[len(bos) :], lone[len(bos) :]))
    for lead, full, lone in readings:
        for turns in FORMATS:
            if full != turns.render(_PROBE):
                continue
            if lone == turns.render(_PROBE[1:2]):
                return ChatMapping(turns, None, lead)
            system_prefix = turns.prefix.format(role="system")
            if lone.startswith(system_prefix):  # a system turn the template adds when the chat has none
                default = lone[len(system_prefix) :].split(turns.end, 1)[0]
                if lone == turns.render([{"role": "system", "content": default}, _PROBE[1]]):
                    return ChatMapping(turns, default, lead)
    return ChatMapping(None, None)


def stop_tokens(tokenizer: Any, model_dir: Path, turns: TurnFormat | None) -> list[str]:
    """End-of-turn and end-of-text token texts: the format's, the tokenizer's EOS, generation_config's EOS ids."""
    stops = list(turns.stops) if turns else []
    ids: list[int] = []
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    except (OSError, ValueError):
        pass
    texts = [tokenizer.eos_token, *tokenizer.convert_ids_to_tokens(ids)]
    for text in texts:
        if text and text not in stops:
            stops.append(text)
    return stops


def write_modelfile(model_dir: Path, gguf_path: Path) -> Path:
    """Write ``<gguf stem>.Modelfile`` beside ``gguf_path`` from the tokenizer in ``model_dir``; return its path.

    Example:
        >>> write_modelfile(Path("merged"), Path("out/chat/exports/step-00000100-q8_0.gguf"))
        PosixPath('out/chat/exports/step-00000100-q8_0.Modelfile')
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    mapping = map_chat_template(tokenizer)
    lines = [
        f"# Ollama: ollama create NAME -f {gguf_path.stem}.Modelfile  (run beside {gguf_path.name})",
        f"FROM ./{gguf_path.name}",
    ]
    if mapping.format is not None:
        lines.append(f"# {mapping.format.name} turns, mapped from the tokenizer's chat template")
        lines.append(f'TEMPLATE """{mapping.ollama_template()}"""')
        if mapping.default_system is not None:
            lines.append(f'SYSTEM """{mapping.default_system}"""')
    elif getattr(tokenizer, "chat_template", None):
        lines.append(
            "# TEMPLATE not written: the chat template is not one Ferry maps to a Go template (ChatML, "
            "Llama 3); Ollama picks one from the tokenizer.chat_template in the GGUF"
        )
    for stop in stop_tokens(tokenizer, model_dir, mapping.format):
        lines.append(f"PARAMETER stop {json.dumps(stop)}")
    target = gguf_path.with_suffix(".Modelfile")
    target.write_text("\n".join(lines) + "\n")
    return target
