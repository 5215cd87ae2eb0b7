"""Batched sampling for GRPO's rollouts: every completion of a step decoded together, one forward per token.

All ``prompts x num_generations`` rows of a step go through the model as one batch, left-padded to the longest
prompt (an attention mask hides the padding, position ids count only real tokens), with a KV cache: the prompt
once (prefill), then one token per row per forward. Under model offload each forward streams every unit's
weights once, so a step's generation costs ``units x decode steps`` copies whatever the number of rows, and the
units ``gpu_memory_budget`` keeps on the device are never copied at all.

A model that takes no KV cache (a Ferry ``transformer_lm``: no attention mask, no position ids) is decoded
without one, its rows batched by prompt length so that no row needs padding.

The loop never waits for the device between forwards but every ``STOP_CHECK_EVERY`` steps: whether every row
has stopped is a CPU-GPU sync, and a sync per step would keep the host from queueing the next step's kernels
while the device runs this one (a decode step is launch-bound). The steps run past the last stop are cut off
the result, which is what stopping at once would have given.
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
    compile_decode: bool = False,
) -> Generated:
    """Continue every prompt (one row each, in order) by at most ``max_new_tokens`` tokens, all rows together.

    ``temperature`` 0 is greedy (argmax); otherwise tokens are drawn from the logits over ``temperature``, within
    the ``top_p`` nucleus. A row stops at any of ``stops`` (eos, the chat template's end of turn); the rest go on
    until all have stopped or ``max_new_tokens`` are out. ``compile_decode`` (``training.compile``, every unit on
    the device): the decode steps of a transformers model run compiled over a static KV cache
    (jobs/objectives/compiled_decode.py), the same tokens; where that does not apply, the eager loop runs.

    Example:
        >>> out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=8, temperature=1.0, device=device)
        >>> out.ids.shape, out.forwards   # (2, <= 8), one forward per decode step for both rows
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each with at least one token")
    sampling = Sampling(max_new_tokens, temperature, top_p, stops, pad_id, device, generator, compile_decode)
    started = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            decode = _decode_with_cache if takes_kv_cache(model) else _decode_by_length
            ids, mask, forwards = decode(model, prompts, sampling)
    finally:
        model.train(was_training)
    return Generated(ids=ids, mask=mask, forwards=forwards, seconds=time.perf_counter() - started)


@dataclass(frozen=True)
class Sampling:
    """How ``generate`` continues the prompts: the arguments both decoding loops and the decoder share."""

    max_new_tokens: int
    temperature: float
    top_p: float
    stops: frozenset[int]
    pad_id: int
    device: torch.device
    generator: torch.Generator | None
    compile_decode: bool = False


def _decode_with_cache(
    model: nn.Module, prompts: Sequence[Sequence[int]], sampling: Sampling
) -> tuple[torch.Tensor, torch.Tensor, int]:
    from transformers import DynamicCache

    if sampling.compile_decode:
        from jobs.objectives.compiled_decode import decode_compiled

        done = decode_compiled(model, prompts, sampling)
        if done is not None:
            return done
    width = max(len(p) for p in prompts)
    device = sampling.device
    # Left padding: every row's last prompt token sits in the last column, so each step's new tokens append
    # as one column for all rows.
    ids = torch.tensor([[sampling.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    # The mask of the whole loop made once; each step reads a wider view of it (a stopped row's pads count as
    # attended, which no kept token ever reads).
    attention_all = torch.tensor(
        [[0] * (width - len(p)) + [1] * (len(p) + sampling.max_new_tokens) for p in prompts], device=device
    )
    positions = (attention_all[:, :width].cumsum(-1) - 1).clamp(min=0)
    # Filled in place by each forward. Given the config, the cache lays out each layer as the model does (a
    # sliding-window layer keeps its window only).
    takes_config = "config" in inspect.signature(DynamicCache.__init__).parameters
    config: Any = getattr(model, "config", None)  # peft's wrapper shows the base model's
    cache = DynamicCache(config=config) if takes_config else DynamicCache()
    cache_arg, last_only = cache_arguments(model)
    # A decode step's mask for SDPA made here, not by the model: given the 2D mask, transformers checks whether
    # any position is padded (``fast_all``, a CPU-GPU sync) on every forward.
    step_masks = attention_all.bool()[:, None, None, :] if _takes_a_padding_mask_as_is(config) else None
    step_input, step_positions = ids, positions
    decode = Decoder(len(prompts), sampling)
    forwards = 0
    while True:
        mask = attention_all if step_masks is None or forwards == 0 else step_masks
        output = model(
            input_ids=step_input,
            attention_mask=mask[..., : width + forwards],
            position_ids=step_positions,
            use_cache=True,
            **{cache_arg: cache},
            **last_only,
        )
        forwards += 1
        token = decode.take(output.logits[:, -1])
        if decode.finished():
            break
        step_input = token.unsqueeze(1)
        step_positions = step_positions[:, -1:] + 1
    return (*decode.result(), forwards)


def _takes_a_padding_mask_as_is(config: Any) -> bool:
    """Whether a one-token decode step's attention mask may be the padding mask itself, ``[rows, 1, 1, keys]``
    (True: attend), which transformers hands to SDPA as it is: SDPA attention, and every layer attending to every
    cached position (a sliding-window layer's mask is the model's to make)."""
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ()
    return getattr(text, "sliding_window", None) is None and all(t == "full_attention" for t in layer_types)


def cache_arguments(model: nn.Module) -> tuple[str, dict[str, int]]:
    """The forward's name for the KV cache (``cache`` in newer transformers, ``past_key_values`` before), and the
    keyword that computes the logits of the last position only, where the forward takes one: the prefill's
    logits over every prompt position and the whole vocabulary are memory no step reads."""
    unwrap = getattr(model, "get_base_model", None)  # peft's wrapper passes the keywords on to this model
    base = unwrap() if callable(unwrap) else model
    parameters = inspect.signature(base.forward).parameters
    last = next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)
    return ("cache" if "cache" in parameters else "past_key_values"), ({last: 1} if last else {})


def _decode_by_length(
    model: nn.Module, prompts: Sequence[Sequence[int]], sampling: Sampling
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """No KV cache and no attention mask: the rows of each prompt length decode together over the whole window."""
    by_length: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(row)
    device, new = sampling.device, sampling.max_new_tokens
    ids_out = torch.full((len(prompts), new), sampling.pad_id, dtype=torch.long, device=device)
    mask_out = torch.zeros((len(prompts), new), dtype=torch.long, device=device)
    forwards, longest = 0, 0
    for rows in by_length.values():
        window = torch.tensor([list(prompts[r]) for r in rows], device=device)
        decode = Decoder(len(rows), sampling)
        while True:
            output = model(input_ids=window)
            forwards += 1
            logits = output if isinstance(output, torch.Tensor) else output.logits
            token = decode.take(logits[:, -1])
            if decode.finished():
                break
            window = torch.cat([window, token.unsqueeze(1)], dim=1)
        ids, mask = decode.result()
        index = torch.tensor(rows, device=device)
        ids_out[index, : ids.shape[1]], mask_out[index, : ids.shape[1]] = ids, mask
        longest = max(longest, ids.shape[1])
    return ids_out[:, :longest], mask_out[:, :longest], forwards


STOP_CHECK_EVERY = 8  # decode steps between the host's looks at whether every row has stopped (a sync)


class Decoder:
    """The per-token choice and the stop bookkeeping both decoding loops share, in buffers made once: a step
    writes one column of each."""

    def __init__(self, rows: int, sampling: Sampling) -> None:
        self.sampling = sampling
        device, new = sampling.device, sampling.max_new_tokens
        self.stops = torch.tensor(sorted(sampling.stops), dtype=torch.long, device=device) if sampling.stops else None
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.pad = torch.full((rows,), sampling.pad_id, dtype=torch.long, device=device)
        self.ids = torch.full((rows, new), sampling.pad_id, dtype=torch.long, device=device)
        self.keep = torch.zeros((rows, new), dtype=torch.bool, device=device)
        self.steps = 0

    def take(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row (``pad_id`` for a row that has stopped) from its last logits."""
        logits = logits.float()
        temperature = self.sampling.temperature
        if temperature == 0:
            token = logits.argmax(-1)
        else:
            token = sample_top_p(logits / temperature, self.sampling.top_p, self.sampling.generator)
        token = torch.where(self.done, self.pad, token)
        self.keep[:, self.steps] = ~self.done
        self.ids[:, self.steps] = token
        self.steps += 1
        if self.stops is not None:
            self.done = self.done | torch.isin(token, self.stops)
        return token

    def finished(self) -> bool:
        """Whether the loop may end: ``max_new_tokens`` taken, or every row stopped, looked at only every
        ``STOP_CHECK_EVERY`` steps (the steps past the last stop are cut off in ``result``)."""
        if self.steps >= self.sampling.max_new_tokens:
            return True
        if self.stops is None or self.steps % STOP_CHECK_EVERY:
            return False
        return bool(self.done.all())  # a CPU-GPU sync point, once per STOP_CHECK_EVERY decode steps

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` and ``mask`` up to the step at which the last row stopped (every step taken without stops)."""
        steps = self.steps
        if self.stops is not None:
            # A CPU-GPU sync point, once per loop: the last column any row kept (each row keeps its first
            # column, so there is one).
            taken = self.keep[:, :steps].any(dim=0)
            steps = int(taken.nonzero().max()) + 1
        return self.ids[:, :steps], self.keep[:, :steps].long()


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
