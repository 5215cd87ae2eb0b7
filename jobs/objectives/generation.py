"""Batched sampling for GRPO's rollouts: every completion of a step decoded together, one forward per token.

All ``prompts x num_generations`` rows of a step go through the model as one batch, left-padded to the longest
prompt (an attention mask hides the padding, position ids count only real tokens), with a KV cache: the prompt
once (prefill), then one token per row per forward. Under model offload each forward streams every unit's
weights once, so a step's generation costs ``units x decode steps`` copies whatever the number of rows, and the
units ``gpu_memory_budget`` keeps on the device are never copied at all.

A model that takes no KV cache (a Ferry ``transformer_lm``: no attention mask, no position ids) is decoded
without one, its rows batched by prompt length so that no row needs padding.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Generated:
    """Sampled completions: ``ids`` ``[rows, T]`` (``pad_id`` after a row's stop), ``mask`` ``[rows, T]`` (1 up to
    and including the stop token, as TRL's ``completion_mask``), the forwards run and the seconds they took."""

    ids: torch.Tensor
    mask: torch.Tensor
    forwards: int
    seconds: float

    @property
    def tokens(self) -> int:
        """Completion tokens sampled (stops included, padding not)."""
        return int(self.mask.sum())


def takes_kv_cache(model: nn.Module) -> bool:
    """Whether ``model`` decodes with a KV cache: a transformers causal LM, bare or peft-wrapped."""
    return callable(getattr(model, "prepare_inputs_for_generation", None)) and hasattr(model, "config")


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    stops: frozenset[int] = frozenset(),
    pad_id: int = 0,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> Generated:
    """Continue every prompt (one row each, in order) by at most ``max_new_tokens`` tokens, all rows together.

    ``temperature`` 0 is greedy (argmax); otherwise tokens are drawn from the logits over ``temperature``, within
    the ``top_p`` nucleus. A row stops at any of ``stops`` (eos, the chat template's end of turn); the rest go on
    until all have stopped or ``max_new_tokens`` are out.

    Example:
        >>> out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=8, temperature=1.0, device=device)
        >>> out.ids.shape, out.forwards   # (2, <= 8), one forward per decode step for both rows
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each with at least one token")
    started = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if takes_kv_cache(model):
                ids, mask, forwards = _decode_with_cache(
                    model, prompts, max_new_tokens, temperature, top_p, stops, pad_id, device, generator
                )
            else:
                ids, mask, forwards = _decode_by_length(
                    model, prompts, max_new_tokens, temperature, top_p, stops, pad_id, device, generator
                )
    finally:
        model.train(was_training)
    return Generated(ids=ids, mask=mask, forwards=forwards, seconds=time.perf_counter() - started)


def _decode_with_cache(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stops: frozenset[int],
    pad_id: int,
    device: torch.device,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    # Left padding: every row's last prompt token sits in the last column, so each step's new tokens append
    # as one column for all rows.
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    # Filled in place by each forward. Given the config, the cache lays out each layer as the model does (a
    # sliding-window layer keeps its window only).
    takes_config = "config" in inspect.signature(DynamicCache.__init__).parameters
    config: Any = getattr(model, "config", None)  # peft's wrapper shows the base model's
    cache = DynamicCache(config=config) if takes_config else DynamicCache()
    cache_arg, last_only = _cache_arguments(model)
    step_input, step_positions = ids, positions
    decode = _Decoder(len(prompts), temperature, top_p, stops, pad_id, device, generator)
    forwards = 0
    while True:
        output = model(
            input_ids=step_input,
            attention_mask=attention,
            position_ids=step_positions,
            use_cache=True,
            **{cache_arg: cache},
            **last_only,
        )
        forwards += 1
        token = decode.take(output.logits[:, -1])
        if decode.finished(max_new_tokens):
            break
        step_input = token.unsqueeze(1)
        step_positions = step_positions[:, -1:] + 1
        attention = torch.cat([attention, torch.ones_like(step_input)], dim=1)  # a stopped row's pads: masked out
    return (*decode.result(), forwards)


def _cache_arguments(model: nn.Module) -> tuple[str, dict[str, int]]:
    """The forward's name for the KV cache (``cache`` in newer transformers, ``past_key_values`` before), and the
    keyword that computes the logits of the last position only, where the forward takes one: the prefill's
    logits over every prompt position and the whole vocabulary are memory no step reads."""
    unwrap = getattr(model, "get_base_model", None)  # peft's wrapper passes the keywords on to this model
    base = unwrap() if callable(unwrap) else model
    parameters = inspect.signature(base.forward).parameters
    last = next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)
    return ("cache" if "cache" in parameters else "past_key_values"), ({last: 1} if last else {})


def _decode_by_length(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stops: frozenset[int],
    pad_id: int,
    device: torch.device,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """No KV cache and no attention mask: the rows of each prompt length decode together over the whole window."""
    by_length: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(row)
    ids_out = torch.full((len(prompts), max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask_out = torch.zeros((len(prompts), max_new_tokens), dtype=torch.long, device=device)
    forwards, longest = 0, 0
    for rows in by_length.values():
        window = torch.tensor([list(prompts[r]) for r in rows], device=device)
        decode = _Decoder(len(rows), temperature, top_p, stops, pad_id, device, generator)
        while True:
            output = model(input_ids=window)
            forwards += 1
            logits = output if isinstance(output, torch.Tensor) else output.logits
            token = decode.take(logits[:, -1])
            if decode.finished(max_new_tokens):
                break
            window = torch.cat([window, token.unsqueeze(1)], dim=1)
        ids, mask = decode.result()
        index = torch.tensor(rows, device=device)
        ids_out[index, : ids.shape[1]], mask_out[index, : ids.shape[1]] = ids, mask
        longest = max(longest, ids.shape[1])
    return ids_out[:, :longest], mask_out[:, :longest], forwards


class _Decoder:
    """The per-token choice and the stop bookkeeping both decoding loops share."""

    def __init__(
        self,
        rows: int,
        temperature: float,
        top_p: float,
        stops: frozenset[int],
        pad_id: int,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> None:
        self.temperature, self.top_p, self.pad_id, self.generator = temperature, top_p, pad_id, generator
        self.stops = torch.tensor(sorted(stops), dtype=torch.long, device=device) if stops else None
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.new: list[torch.Tensor] = []
        self.keep: list[torch.Tensor] = []

    def take(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row (``pad_id`` for a row that has stopped) from its last logits."""
        logits = logits.float()
        if self.temperature == 0:
            token = logits.argmax(-1)
        else:
            token = sample_top_p(logits / self.temperature, self.top_p, self.generator)
        token = torch.where(self.done, torch.full_like(token, self.pad_id), token)
        self.keep.append(~self.done)
        self.new.append(token)
        if self.stops is not None:
            self.done = self.done | torch.isin(token, self.stops)
        return token

    def finished(self, max_new_tokens: int) -> bool:
        # A CPU-GPU sync point, once per decode step: whether every row has stopped.
        return len(self.new) >= max_new_tokens or bool(self.done.all())

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.new, dim=1), torch.stack(self.keep, dim=1).long()


def sample_top_p(logits: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row drawn from ``softmax(logits)`` within the smallest set of tokens whose probability
    reaches ``top_p`` (all of them at 1)."""
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
