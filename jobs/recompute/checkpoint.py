"""Activation checkpointing of a model's blocks with torch's reentrant checkpoint: the least host work.

Used for a DiT's blocks (diffusers calls ``checkpoint_block`` as its ``gradient_checkpointing_func``) and for
Ferry's own ``transformer_lm``; ``hf_causal_lm`` asks transformers for the same variant, through
``checkpoint_layer`` (the layers' module hooks run in the recompute whatever transformers' version).

torch's non-reentrant checkpoint (diffusers' default) runs Python hooks for every tensor a block saves: two
when the forward saves it, one more in the recompute and one when backward unpacks it. A Qwen-Image block
saves over a hundred tensors, so on a deep DiT those hooks are most of the step's Python calls
(``python bench/diffusion_host_calls.py`` counts them; bench/RESULTS.md has the figures). A DiT step on a fast
GPU is bound by the host issuing kernels, so host work per step is step time, offloaded or not.

The reentrant variant runs the block under ``no_grad`` in forward, keeps only its inputs, and in backward
recomputes the block and backpropagates through it inside one autograd node. The values and gradients are the
same: tests/jobs/models/diffusion/test_block_checkpoint.py checks a DiT's gradients bitwise on the CPU against training
without checkpointing, and whole jobs' losses and saved adapters with and without the offload engine (which
supports both variants).

What it needs: an input that requires grad, or autograd never reaches the block's trainable parameters. With
LoRA on a frozen patch embedding the hidden states entering the first block do not require grad, so here they
are made to, on a detached alias (what transformers' ``enable_input_require_grads`` does for LLMs): the block's
output then requires grad and backward reaches its adapters. Keyword arguments, which the reentrant variant
does not take, fall back to the non-reentrant one.

Rows that need no gradient (``only_first_rows_need_gradient``): DPO's LoRA reference rows ride the policy's
forward for the weights it has on the device, but their log-probs are detached, so the gradient reaching them is
zero in every layer. Inside that context a checkpointed layer still runs every row in its forward, but keeps and
recomputes only the first rows, and hands the others a zero gradient: the recompute and the backward do the
policy's work alone, not twice it. A layer whose forward drew random numbers (dropout) keeps every row, as a
recompute of fewer rows would draw other ones.

While a checkpoint recomputes (``recomputing()``), what the recompute's outputs are worth is their graph: backward
reads no value of a layer's output. A tiled MLP whose output only the residual sum reads skips its forward there
(jobs/recompute/tiled_mlp.py).

One difference from torch's reentrant checkpoint: an output that backward does not reach gets no gradient,
where torch's hands the block a zero one (it materializes missing gradients). A Qwen-Image block returns the
text stream too, which the last block's caller drops; with zeros, that block's text-side adapters would get
zero gradients instead of none, and AdamW would still decay and move them, unlike training without
checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction, checkpoint, detach_variable

from jobs.recompute.flags import in_recompute, rows_needing_gradient
from jobs.recompute.replay import ForwardState


def checkpoint_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``block(*args)`` checkpointed (module docstring); diffusers' ``gradient_checkpointing_func``."""
    if kwargs:
        return checkpoint(block.__call__, *args, use_reentrant=False, **kwargs)
    args = _with_an_input_that_requires_grad(block, args)
    if not torch.is_grad_enabled() or not any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args):
        return block(*args)  # no gradient passes through: nothing to save, nothing to recompute
    rows = _trimmed_rows(args)
    trimmed = None if rows is None else (rows, block.__call__)
    return _ReentrantCheckpoint.apply(block.__call__, True, trimmed, *args)


def checkpoint_layer(function: Callable[..., Any], *args: Any) -> Any:
    """A transformers decoder layer's ``_gradient_checkpointing_func``: torch's reentrant checkpoint, with the
    layer's module hooks run in the recompute.

    transformers up to 5.17 checkpointed the layer's ``__call__``, hooks inside. Later versions checkpoint its
    ``forward`` (``partial(forward, layer, **kwargs)``) and keep the module hooks outside, so that FSDP2's do not
    run twice. The offload engine's hooks on a block unit are what brings its weights back to the device for
    the recompute: without them the recompute reads the host copies (on a GPU, a device mismatch; on the CPU the
    same values, so only pointers tell). For such a function the recompute calls the layer itself, its
    checkpointing switched off for that call so it does not checkpoint again; the checkpoint's own forward
    (under ``no_grad``) runs ``forward`` as given, the hooks having run around it already.
    """
    found = _layer_of(function)
    rows = _trimmed_rows(args)
    if found is None:  # a layer's __call__ (transformers <= 5.17) or any other function: hooks already inside
        if rows is None:
            return checkpoint(_flagging_the_recompute(function), *args, use_reentrant=True)
        return _ReentrantCheckpoint.apply(function, True, (rows, _first_rows_of_call(function, rows, args)), *args)
    layer, kwargs = found

    def recompute(**bound: Any) -> Callable[..., Any]:
        def run(*inputs: Any) -> Any:
            if not torch.is_grad_enabled():  # the checkpoint's forward
                return function(*inputs)
            layer.gradient_checkpointing = False  # the recompute, through __call__ and its hooks
            try:
                with in_recompute():
                    return layer(*inputs, **bound)
            finally:
                layer.gradient_checkpointing = True

        return run

    if rows is None:
        return checkpoint(recompute(**kwargs), *args, use_reentrant=True)
    total = _rows_of(args)
    first = recompute(**_first_rows(kwargs, rows, total))
    return _ReentrantCheckpoint.apply(recompute(**kwargs), True, (rows, first), *args)


def _flagging_the_recompute(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` for torch's reentrant checkpoint, which runs it without grad in the forward and with grad in
    the recompute: there, inside ``_in_recompute``."""

    @functools.wraps(function)
    def run(*inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*inputs)
        with in_recompute():
            return function(*inputs)

    return run


def _trimmed_rows(args: tuple[Any, ...]) -> int | None:
    """How many rows a checkpointed call over ``args`` keeps; None: all."""
    return rows_needing_gradient(_rows_of(args))


def _rows_of(args: tuple[Any, ...]) -> int | None:
    """The batch's rows: the first dimension of the first tensor of at least two dimensions (the hidden states)."""
    return next((arg.shape[0] for arg in args if isinstance(arg, torch.Tensor) and arg.dim() >= 2), None)


def _per_row(value: Any, total: int | None) -> bool:
    """Whether ``value`` is a per-row tensor of a batch of ``total`` rows (two or more dimensions, ``total`` first)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == total


def _first_rows(value: Any, rows: int, total: int | None) -> Any:
    """``value`` with every per-row tensor in it (``_per_row``) cut to its first rows."""
    if isinstance(value, torch.Tensor):
        return value[:rows] if _per_row(value, total) else value
    if isinstance(value, tuple | list):
        return type(value)(_first_rows(item, rows, total) for item in value)
    if isinstance(value, dict):
        return {key: _first_rows(item, rows, total) for key, item in value.items()}
    return value


def _first_rows_of_call(function: Callable[..., Any], rows: int, args: tuple[Any, ...]) -> Callable[..., Any]:
    """``function`` with the per-row tensors it has bound (a ``partial``'s keywords) cut to their first rows."""
    if not isinstance(function, functools.partial):
        return function
    total = _rows_of(args)
    return functools.partial(function.func, *_first_rows(function.args, rows, total),
                             **_first_rows(function.keywords, rows, total))  # fmt: skip


def _layer_of(function: Callable[..., Any]) -> tuple[Any, dict[str, Any]] | None:
    """The layer and keyword arguments of ``partial(forward, layer, **kwargs)``, transformers' checkpointed
    ``forward``; else None."""
    if isinstance(function, functools.partial) and len(function.args) == 1:
        layer = function.args[0]
        if isinstance(layer, nn.Module) and getattr(layer, "gradient_checkpointing", False):
            return layer, function.keywords
    return None


def _with_an_input_that_requires_grad(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    if any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args):
        return args
    if not any(param.requires_grad for param in block.parameters()):
        return args  # nothing in the block trains: no gradient has to pass through it
    for index, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            # A tensor that does not require grad is a leaf, so the alias adds no node to the graph; its
            # gradient is computed (one activation's worth) and dropped with the graph.
            return (*args[:index], arg.detach().requires_grad_(True), *args[index + 1 :])
    return args


class _ReentrantCheckpoint(CheckpointFunction):
    """torch's reentrant checkpoint (its forward, and its backward but for gradients that never came).

    ``trimmed``: None, or (rows, the function to recompute the first rows with): the rows after them need no
    gradient (``only_first_rows_need_gradient``), so unless the forward drew random numbers only the first rows
    are kept, recomputed and backpropagated, and the others get a zero gradient.
    """

    @staticmethod
    def forward(ctx: Any, run_function: Any, preserve_rng_state: bool, trimmed: Any, *args: Any) -> Any:
        ctx.set_materialize_grads(False)  # an output backward did not reach arrives as None, not zeros
        ctx.state = ForwardState.capture(*args)  # before the forward: the recompute replays it
        outputs = CheckpointFunction.forward(ctx, run_function, preserve_rng_state, *args)
        ctx.trimmed = None
        if trimmed is not None and preserve_rng_state and not ctx.state.drew_random_numbers():
            rows, recompute = trimmed
            total = _rows_of(args)
            cut = frozenset(i for i in ctx.tensor_indices if _per_row(args[i], total))
            ctx.run_function, ctx.trimmed = recompute, (rows, total, cut)
            # A copy, not a view: a view would keep the whole batch's storage alive until backward.
            ctx.save_for_backward(*(args[i][:rows].clone() if i in cut else args[i] for i in ctx.tensor_indices))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "a block checkpointed by checkpoint_block works with .backward() only, not torch.autograd.grad()"
            )
        inputs = list(ctx.inputs)
        for index, tensor in zip(ctx.tensor_indices, ctx.saved_tensors, strict=True):
            inputs[index] = tensor
        # The recompute draws the forward's random numbers (dropout) under the forward's autocast.
        with ctx.state.replay(random_numbers=ctx.preserve_rng_state):
            detached = detach_variable(tuple(inputs))
            if ctx.trimmed is not None:  # a kept copy was made without grad: it takes its input's flag
                for index in ctx.trimmed[2]:
                    detached[index].requires_grad_(ctx.needs_input_grad[3 + index])
            with torch.enable_grad(), in_recompute():
                outputs = ctx.run_function(*detached)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        if ctx.trimmed is not None:
            grads = _first_rows(grads, *ctx.trimmed[:2])
        reached = [
            (out, grad)
            for out, grad in zip(outputs, grads, strict=True)
            if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if reached:
            torch.autograd.backward([out for out, _ in reached], [grad for _, grad in reached])
        found = [arg.grad if isinstance(arg, torch.Tensor) else None for arg in detached]
        if ctx.trimmed is not None:
            _, total, cut = ctx.trimmed
            found = [_zero_rows_after(grad, total) if i in cut else grad for i, grad in enumerate(found)]
        return (None, None, None, *found)


def _zero_rows_after(grad: torch.Tensor | None, total: int) -> torch.Tensor | None:
    """The gradient of a trimmed input: the kept rows' as computed, zeros for the rest of its ``total``."""
    if grad is None:
        return None
    return torch.cat([grad, grad.new_zeros(total - grad.shape[0], *grad.shape[1:])])
