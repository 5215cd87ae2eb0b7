"""Preference pairs (``data.format: preference``): a prompt, a chosen and a rejected completion.

Two layouts are read, per record:
- TRL's preference layout: ``prompt`` (a message list or a string), ``chosen`` and ``rejected`` (each a
  message list or a string).
- OpenAI's fine-tuning DPO layout: ``input.messages``, ``preferred_output`` and ``non_preferred_output``
  (message lists).

The chat template renders the prompt with the assistant's header (``add_generation_prompt``); a completion is
what the template adds after it for the prompt plus that completion, as TRL renders conversational pairs
(a ``tools`` column, tool calls and reasoning included, as chat records: chat.py). Three strings (TRL's
standard layout) are raw text, as TRL reads them: no chat template, EOS after each completion; the job's log
counts such pairs. TRL's implicit-prompt and unpaired layouts are refused, naming what to convert them to.
Only completion tokens carry labels. A batch holds the chosen rows first, then the rejected rows of the same
pairs (one forward for both, as TRL's ``concatenated_forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from jobs.data.formats.chat import check_messages
from jobs.data.formats.examples import IGNORE, Example, RecordError
from jobs.data.formats.rendering import check_rendered, template_messages
from jobs.data.formats.tools import check_tools
from jobs.data.formats.trl import IMPLICIT_PROMPT, layout_refusal
from jobs.data.padded import pad_examples
from jobs.data.tokenizers import HFTokenizer


@dataclass
class PreferencePair:
    """One tokenized pair: the prompt's ids and the two completions' ids; ``cut`` tokens were truncated."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    cut: int = 0
    raw: bool = False  # TRL's standard layout (strings), read as plain text without the chat template

    def example(self, completion: list[int]) -> Example:
        """Prompt plus ``completion``, labels on the completion only."""
        return Example(self.prompt + completion, [IGNORE] * len(self.prompt) + completion)


def preference_pair(fields: dict[str, Any], tokenizer: HFTokenizer) -> PreferencePair:
    """The tokens of one preference record (either layout, see the module docstring).

    Raises:
        RecordError: naming the missing or malformed field, a layout Ferry does not train (naming it and
            what to convert it to), or a template that does not render the completion after the prompt or
            leaves out a tool call or reasoning (rendering.py).
    """
    if all(isinstance(fields.get(name), str) for name in ("prompt", "chosen", "rejected")):
        return _standard_pair(fields, tokenizer)
    (prompt, prompt_places), chosen, rejected = _conversations(fields)
    tools = check_tools(fields.get("tools"))

    def render(messages: list[dict[str, Any]], with_tools: list[dict[str, Any]] | None = tools) -> str:
        return _render(tokenizer, messages, generation_prompt=False, tools=with_tools)

    prompt_texts, completions = set(), []
    for name, (completion, places) in (("chosen", chosen), ("rejected", rejected)):
        plain = template_messages(prompt + completion, prompt_places + places, render)
        check_rendered(plain, prompt_places + places, tools, render, "tools")
        prompt_text = _render(tokenizer, plain[: len(prompt)], generation_prompt=True, tools=tools)
        full = render(plain)
        if not full.startswith(prompt_text):
            raise RecordError(
                name, "the chat template does not render the completion after the prompt; set data.chat_template"
            )
        ids = tokenizer.encode(full[len(prompt_text) :])
        if not ids:
            raise RecordError(name, "renders to no token, so there is nothing to compare")
        prompt_texts.add(prompt_text)
        completions.append(ids)
    if len(prompt_texts) > 1:  # the template rendered the shared prompt two ways (reasoning keys differ)
        raise RecordError("prompt", "renders differently before chosen and before rejected; use one reasoning key")
    return PreferencePair(tokenizer.encode(prompt_texts.pop()), completions[0], completions[1])


def _standard_pair(fields: dict[str, Any], tokenizer: HFTokenizer) -> PreferencePair:
    """TRL's standard layout (three strings) as TRL reads it: raw text, no chat template, EOS after each
    completion, which starts where the tokens of prompt and prompt + completion diverge."""
    prompt = tokenizer.encode(fields["prompt"])
    joined = [tokenizer.encode(fields["prompt"] + fields[name]) for name in ("chosen", "rejected")]
    shared = min(_common_prefix(prompt, ids) for ids in joined)
    completions = []
    for name, ids in zip(("chosen", "rejected"), joined, strict=True):
        completion = ids[shared:]
        if not completion:
            raise RecordError(name, "is empty, so there is nothing to compare")
        if tokenizer.eos_id is not None and completion[-1] != tokenizer.eos_id:
            completion.append(tokenizer.eos_id)  # the model learns to stop, as TRL's add_eos
        completions.append(completion)
    return PreferencePair(prompt[:shared], completions[0], completions[1], raw=True)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def truncate(pair: PreferencePair, seq_len: int) -> PreferencePair:
    """``pair`` within ``seq_len`` tokens: the prompt keeps its end (at least one token, which predicts the
    first completion token), then the completions keep their start; ``cut`` counts the tokens dropped."""
    longest = max(len(pair.chosen), len(pair.rejected))
    if len(pair.prompt) + longest <= seq_len:
        return pair
    keep = max(1, min(len(pair.prompt), seq_len - longest))
    room = seq_len - keep
    prompt, chosen, rejected = pair.prompt[-keep:], pair.chosen[:room], pair.rejected[:room]
    cut = sum(len(a) - len(b) for a, b in ((pair.prompt, prompt), (pair.chosen, chosen), (pair.rejected, rejected)))
    return PreferencePair(prompt, chosen, rejected, cut, pair.raw)


Turns = tuple[list[dict[str, Any]], list[str]]  # checked messages and the name of each, for errors


def _conversations(fields: dict[str, Any]) -> tuple[Turns, Turns, Turns]:
    # A file mixing both layouts reads through ``datasets`` with the other layout's keys present as None.
    if fields.get("preferred_output") is not None or fields.get("input") is not None:  # OpenAI's DPO layout
        source = fields.get("input")
        if not isinstance(source, dict):
            raise RecordError("input", "must be an object with messages (OpenAI's DPO layout)")
        prompt = _messages(source.get("messages"), "input.messages", prompt=True)
        names = ("preferred_output", "non_preferred_output")
    else:
        missing = next((name for name in ("chosen", "rejected") if fields.get(name) is None), None)
        if missing is not None and (refusal := layout_refusal(fields, "preference", missing)) is not None:
            raise refusal  # unpaired, stepwise, prompt-completion or prompt-only rows: named, with the fix
        if fields.get("prompt") is None and fields.get("chosen") is not None:
            raise RecordError("prompt", IMPLICIT_PROMPT)
        prompt = _messages(fields.get("prompt"), "prompt", prompt=True)
        names = ("chosen", "rejected")
    chosen, rejected = (_messages(fields.get(name), name, prompt=False) for name in names)
    return prompt, chosen, rejected


def _messages(value: Any, field: str, *, prompt: bool) -> Turns:
    """A string becomes one user turn (a prompt) or one assistant turn (a completion)."""
    if value is None:
        raise RecordError(field, "is missing; preference records need prompt, chosen and rejected")
    if isinstance(value, str):
        return [{"role": "user" if prompt else "assistant", "content": value}], [field]
    if prompt:
        if not isinstance(value, list) or not value:
            raise RecordError(field, "must be a non-empty list of {role, content} objects or a string")
        checked = check_messages(value, field, need_assistant=False)  # the completions hold the assistant turns
    else:
        checked = check_messages(value, field)
        if checked[-1]["role"] != "assistant":
            raise RecordError(field, "must end with an assistant message (the completion)")
    return checked, [f"{field}[{i}]" for i in range(len(checked))]


def _render(
    tokenizer: HFTokenizer,
    messages: list[dict[str, Any]],
    *,
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=generation_prompt, tools=tools)
    except Exception as error:  # jinja2's TemplateError and whatever a template raises
        raise RecordError("prompt", f"the chat template failed: {type(error).__name__}: {error}") from None


class PreferenceBatches:
    """Pairs in seeded random order, ``batch_size`` pairs a batch: ``2 * batch_size`` rows, right-padded,
    chosen rows first. Batch ``i`` is a pure function of (seed, i), so resume is exact.

    Given the reference model's log-probs (`use_reference`), a batch also carries ``reference_logps``, one per
    row, looked up by each pair's place in ``pairs``: they travel with their rows through the shuffle and into a
    rank's share of the batch (jobs/distributed/batches.py takes the same rows of every field).
    """

    def __init__(self, pairs: list[PreferencePair], batch_size: int, seed: int, pad_id: int) -> None:
        if len(pairs) < batch_size:
            raise ValueError(
                f"data yields {len(pairs)} preference pair(s), fewer than training.batch_size={batch_size}; "
                "add data or lower the batch size"
            )
        self.pairs, self.batch_size, self.seed, self.pad_id = pairs, batch_size, seed, pad_id
        self.batches_per_epoch = len(pairs) // batch_size
        lengths = [2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs]
        self.tokens_per_sample = round(sum(lengths) / len(pairs))  # a sample is a pair: both rows
        self._order: tuple[int, list[int]] | None = None
        self.reference: torch.Tensor | None = None  # [pairs, 2]: chosen, rejected

    def use_reference(self, table: torch.Tensor) -> None:
        """Carry ``table`` (``[len(pairs), 2]``: each pair's summed reference log-probs of its chosen and its
        rejected completion) in every batch from now on."""
        if tuple(table.shape) != (len(self.pairs), 2):
            raise ValueError(f"reference log-probs of shape {tuple(table.shape)} for {len(self.pairs)} pairs")
        self.reference = table.float().cpu()

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th micro-batch (CPU tensors), counting across epochs."""
        epoch, within = divmod(index, self.batches_per_epoch)
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self), generator=generator).tolist())
        return self._collate(self._order[1][within * self.batch_size : (within + 1) * self.batch_size])

    def in_order(self, index: int) -> dict[str, torch.Tensor]:
        """Batch ``index`` in stored order."""
        return self._collate(list(range(index * self.batch_size, min(len(self), (index + 1) * self.batch_size))))

    def _collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = collate_pairs([self.pairs[i] for i in indices], self.pad_id)
        if self.reference is not None:
            chosen, rejected = self.reference[indices].unbind(1)
            batch["reference_logps"] = torch.cat([chosen, rejected])  # the rows' order: chosen, then rejected
        return batch


def collate_pairs(pairs: list[PreferencePair], pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` (-100 off the completions) and ``attention_mask`` of the chosen rows, then the
    rejected rows, right-padded to the longest row."""
    return pad_examples([p.example(p.chosen) for p in pairs] + [p.example(p.rejected) for p in pairs], pad_id)
