"""``training.compile`` for GRPO's decode loop: the one-token forward compiled over a static KV cache.

An eager decode step of a LoRA policy is launch-bound: transformers and peft run thousands of small kernels per
token, each paid in host time (bench/decode_overhead.py). Compiled over transformers' ``StaticCache`` (its
tensors made once, ``batch x (prompt + max_new_tokens)``, written in place at ``cache_position``), every step
has the same shapes, so one graph serves every step of every generation of that shape; on CUDA
``mode="reduce-overhead"`` replays it as a CUDA graph, one launch per step. The prefill stays eager (one
forward per generation, of another shape).

The weights are graph inputs (dynamo's ``inline_inbuilt_nn_modules``), read where they lie at each call: LoRA
adapters the optimizer updated in place between two generations are the next generation's, nothing captured
goes stale. A CUDA graph reads them at the addresses it recorded, which in-place updates keep; a weight that
moved (a unit the engine held in new memory) makes cudagraph trees record again, not compile again.

The step is compiled once per model and kept on it (``DecodeStep.of``) with its cache: a second generation of the
same shape reuses the graph and the cache's tensors (which stay allocated between generations, as the CUDA graph's
memory pool does), and the sampler (temperature, top_p, the generator's draws, the stops) stays eager, outside
the graph, so the same seeds give the same tokens as the eager loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)
BACKEND = "inductor"  # torch.compile's default; CPU tests use "aot_eager" (the same graphs, no code generation)
_ATTRIBUTE = "_ferry_decode_step"  # where a model keeps its compiled step between generations
_FAILED_ATTRIBUTE = "_ferry_decode_step_failed"  # why compiling it failed, where it did


class DecodeStep:
    """A model's compiled one-token forward: ``logits = step(model, ids, positions, cache_position, mask, cache)``
    gives the last position's logits ``[rows, vocab]``."""

    def __init__(self, device: torch.device, cache_arg: str) -> None:
        mode = "reduce-overhead" if device.type == "cuda" else None
        self.cuda_graphs = mode is not None
        self.cache_arg = cache_arg  # the forward's name for the KV cache
        self.compiled = torch.compile(_one_token_logits, backend=BACKEND, mode=mode, dynamic=False)
        self._cache: Any = None
        self._cache_key: tuple[Any, ...] = ()

    def cache(self, model: nn.Module, rows: int, positions: int, device: torch.device) -> Any:
        """The ``StaticCache`` of ``rows x positions``, emptied: the same tensors for every generation of that shape
        (as transformers' own compiled ``generate`` keeps it), so a CUDA graph finds them where it recorded them
        instead of recording again each generation. A new shape replaces it."""
        from transformers import StaticCache

        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        key = (rows, positions, str(device), autocast)
        if self._cache is None or key != self._cache_key:
            self._cache = None  # the old one's memory first
            config: Any = getattr(model, "config", None)  # peft's wrapper shows the base model's
            self._cache, self._cache_key = StaticCache(config=config, max_cache_len=positions), key
        else:
            self._cache.reset()
        return self._cache

    @classmethod
    def of(cls, model: nn.Module, device: torch.device, cache_arg: str) -> DecodeStep:
        """The step compiled for ``model`` (made on its first generation, reused after)."""
        step = model.__dict__.get(_ATTRIBUTE)
        if not isinstance(step, DecodeStep) or step.cuda_graphs != (device.type == "cuda"):
            step = cls(device, cache_arg)
            model.__dict__[_ATTRIBUTE] = step  # not a submodule, not in the state dict
        return step

    def __call__(self, model: nn.Module, *args: Any) -> torch.Tensor:
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's output is read: its buffers may be reused
        logits = self.compiled(model, self.cache_arg, *args)
        # A CUDA graph's output lives in its pool until the next replay: the sampler reads a copy of its own.
        return logits.clone() if self.cuda_graphs else logits


def _one_token_logits(
    model: nn.Module,
    cache_arg: str,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Any,
) -> torch.Tensor:
    output = model(
        input_ids=input_ids,
        position_ids=position_ids,
        cache_position=cache_position,
        attention_mask=attention_mask,
        use_cache=True,
        **{cache_arg: cache},
    )
    return output.logits[:, -1]


def mark_static_addresses(cache: Any) -> None:
    """Mark every tensor the cache's layers hold (keys, values, their write position) as a static address.

    Each step writes the cache in place. Cudagraph trees replay a graph that mutates an input only where that input
    is a parameter or a static address (one whose memory the graph may keep: it is not copied in before each replay,
    and a new address records again instead of being read stale); any other mutated input makes inductor skip the
    graph ("mutated inputs"): the step runs without one. transformers marks a layer's tensors where it makes them,
    except while dynamo traces; marked here, eagerly, once the prefill has made them, they are static addresses
    whoever made them. Marking is idempotent: a cache reused by a later generation is marked again at no cost.
    """
    for layer in getattr(cache, "layers", ()):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                torch._dynamo.mark_static_address(value)


_fallbacks_logged: set[str] = set()


def _fall_back(why: str) -> None:
    """One log line per reason and process: the eager loop runs instead."""
    if why not in _fallbacks_logged:
        _fallbacks_logged.add(why)
        log.info("training.compile: generation decodes eagerly: %s", why)


def decode_compiled(
    model: nn.Module, prompts: Sequence[Sequence[int]], sampling: Any
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``generation._decode_with_cache`` with the decode steps compiled (the prefill eager), or None where that
    does not apply (why: logged once): a class that takes no ``StaticCache``, or compiling or running it raising.
    Nothing of a failed try is kept: the eager loop starts over from the prompts (the generator's state too)."""
    from jobs.objectives.generation import Decoder, cache_arguments

    why = model.__dict__.get(_FAILED_ATTRIBUTE) or static_cache_unsupported(model)
    if why:
        _fall_back(why)
        return None
    generator = sampling.generator
    state = generator.get_state() if generator is not None else None
    try:
        return _decode(model, prompts, sampling, Decoder, cache_arguments(model))
    except Exception as error:  # dynamo, inductor or a cudagraph failure: the eager loop is always correct
        if generator is not None and state is not None:
            generator.set_state(state)
        why = f"compiling the decode step failed ({type(error).__name__}: {error})".splitlines()[0][:300]
        _fall_back(why)
        model.__dict__.pop(_ATTRIBUTE, None)
        model.__dict__[_FAILED_ATTRIBUTE] = why  # later generations go eager at once, not compiling again
        return None


def static_cache_unsupported(model: nn.Module) -> str:
    """Why ``model``'s transformers class cannot decode over a compiled ``StaticCache`` ('' where it can)."""
    unwrap = getattr(model, "get_base_model", None)  # peft's wrapper
    base = unwrap() if callable(unwrap) else model
    if not getattr(base, "_can_compile_fullgraph", False):
        return f"{type(base).__name__} does not support a static KV cache under torch.compile"
    return ""


def _decode(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: Any,
    make_decoder: Any,
    cache_arguments: tuple[str, dict[str, int]],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    width = max(len(p) for p in prompts)
    device, new = sampling.device, sampling.max_new_tokens
    ids = torch.tensor([[sampling.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    # One mask over the whole cache, the same tensor every step: causality (``cache_position``) hides the
    # positions not written yet, so the step's inputs keep their shapes.
    mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + new) for p in prompts], device=device)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    cache_arg, last_only = cache_arguments
    step = DecodeStep.of(model, device, cache_arg)
    cache = step.cache(model, len(prompts), width + new, device)
    decode = make_decoder(len(prompts), sampling)
    # The prefill: eager, once per generation, of its own width. Eager through training.compile's compiled blocks
    # too: passed the cache, a block's graph would specialize on each layer's index into it (one graph per layer,
    # and more once the cache's layers are made), where the block is compiled to share one graph.
    with torch.compiler.set_stance("force_eager"):
        output = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache_position=torch.arange(width, device=device),
            use_cache=True,
            **{cache_arg: cache},
            **last_only,
        )
    mark_static_addresses(cache)  # after the prefill made the layers' tensors, before the first compiled step
    token = decode.take(output.logits[:, -1])
    forwards = 1
    step_positions = positions[:, -1:]
    cache_position = torch.full((1,), width, dtype=torch.long, device=device)
    while not decode.finished():
        step_positions = step_positions + 1
        logits = step(model, token.unsqueeze(1), step_positions, cache_position, mask, cache)
        forwards += 1
        token = decode.take(logits)
        cache_position = cache_position + 1
    return (*decode.result(), forwards)
