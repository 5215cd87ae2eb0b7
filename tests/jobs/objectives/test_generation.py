"""GRPO's batched sampling: one decode loop for every prompt and completion of a step, with a KV cache.

Left-padded batched greedy decoding gives the tokens one-prompt-at-a-time greedy decoding gives; under model
offload a step's generation copies each unit once per decode step, however many sequences it decodes, and a
unit ``gpu_memory_budget`` keeps on the device is not copied at all.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from jobs.evaluate.text_samples import greedy_completion
from jobs.objectives.generation import generate, takes_kv_cache
from jobs.objectives.grpo import GRPOLoss
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.llm_helpers import tiny_llama

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 3], [5, 5, 5, 1], [8]]  # different lengths: the short ones left-padded


def one_at_a_time(model: torch.nn.Module, prompt: list[int], new: int, stops: frozenset[int]) -> list[int]:
    """The reference: one sequence, the whole window each step, no cache, no padding."""
    return greedy_completion(
        model, prompt, max_new_tokens=new, eos_id=stops, context=256, device=CPU, accelerator=Accelerator(cpu=True)
    )


def tiny_mistral_with_a_sliding_window() -> torch.nn.Module:
    """A decoder whose attention sees 3 positions back: the cache keeps each layer's window only."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=3)  # fmt: skip
    return MistralForCausalLM(config)


@pytest.mark.parametrize("build", [lambda: tiny_llama(64), tiny_mistral_with_a_sliding_window])
def test_batched_greedy_gives_each_prompts_own_greedy_tokens(build: Any) -> None:
    model = build().double()  # float64: a different batch shape rounds alike, so argmax ties cannot flip
    assert takes_kv_cache(model)
    out = generate(model, PROMPTS, max_new_tokens=10, temperature=0, device=CPU)
    assert out.forwards == 10 and out.ids.shape == (4, 10) and out.mask.all()
    assert out.ids.tolist() == [one_at_a_time(model, p, 10, frozenset()) for p in PROMPTS]


def test_a_stopped_row_is_padded_while_the_others_go_on() -> None:
    model = tiny_llama(64).double()
    free = generate(model, PROMPTS, max_new_tokens=10, temperature=0, device=CPU).ids.tolist()
    stop = free[1][3]  # the second row's fourth token ends its completion
    stops = frozenset({stop})
    out = generate(model, PROMPTS, max_new_tokens=10, temperature=0, stops=stops, pad_id=63, device=CPU)
    for row, prompt in enumerate(PROMPTS):
        expected = one_at_a_time(model, prompt, 10, stops)  # the reference leaves the stop token out
        kept = out.mask[row].sum().item()
        ids = out.ids[row].tolist()
        stopped = len(expected) < 10
        assert kept == len(expected) + stopped  # the mask covers the stop token, as TRL's completion_mask does
        assert ids[: len(expected)] == expected and (not stopped or ids[len(expected)] == stop)
        assert all(t == 63 for t in ids[kept:])  # after its stop a row holds padding only
    assert out.mask[1].tolist()[:5] == [1, 1, 1, 1, 0]


def test_a_model_without_a_kv_cache_decodes_its_prompts_batched_by_length() -> None:
    from jobs.models.transformer_lm import TransformerLMSpec, build_transformer_lm

    spec = TransformerLMSpec(kind="transformer_lm", vocab_size=32, hidden_size=32, num_layers=2, num_heads=4)
    model = build_transformer_lm(spec, seed=0).double()
    assert not takes_kv_cache(model)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    out = generate(model, prompts, max_new_tokens=5, temperature=0, device=CPU)
    assert out.forwards == 3 * 5  # three prompt lengths, each decoded as one batch
    assert out.ids.tolist() == [one_at_a_time(model, p, 5, frozenset()) for p in prompts]


def grpo(**overrides: Any) -> Any:
    from jobs.spec.llm import GRPOSpec

    grader = {"type": "string_check", "reference": "{{item.answer}}", "operation": "like"}
    return GRPOSpec.model_validate({"num_generations": 4, "max_new_tokens": 6, "grader": grader, **overrides})


def count_unit_copies(manager: OffloadTrainingManager) -> Counter[str]:
    """How often each unit is onloaded from here on (the engine's copy of its weights to the device)."""
    counts: Counter[str] = Counter()
    for unit in manager.units:
        onload = unit.onload

        def counted(unit_name: str = unit.name, onload: Any = onload) -> None:
            counts[unit_name] += 1
            onload()

        unit.onload = counted  # type: ignore[method-assign]
    return counts


def rollout(model: torch.nn.Module, prompts: list[list[int]], **overrides: Any) -> Any:
    loss = GRPOLoss(grpo(**overrides), lambda completions, rows: [0.0] * len(completions), str)
    rows = [{"prompt": "p", "answer": "a"}] * len(prompts)
    return loss.rollout(model, prompts, rows, stops=frozenset(), pad_id=0, device=CPU), loss


def test_offloaded_generation_copies_each_unit_once_per_decode_step_not_once_per_sequence() -> None:
    model = tiny_llama(64)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(prefetch=0))
    streamed = sum(unit.streamed_bytes for unit in manager.units)
    counts = count_unit_copies(manager)
    before = manager.stats()
    prompts = [[1, 2, 3, 4], [7, 8], [3, 3, 3]]
    done, loss = rollout(model, prompts)  # 3 prompts x 4 completions = 12 sequences, 6 decode steps
    assert done.batch["input_ids"].shape[0] == 12 and loss.take_metrics()["generated_tokens"] == 12 * 6
    assert set(counts) == {unit.name for unit in manager.units}
    assert set(counts.values()) == {6}  # every unit once per decode step: layers x steps, not x 12 sequences
    after = manager.stats()
    moved = (after.h2d_bytes - before.h2d_bytes) + (after.reused_bytes - before.reused_bytes)
    assert moved == 6 * streamed  # each step's forward streams the weights once for the whole batch


def test_units_the_budget_keeps_resident_are_not_copied_during_generation() -> None:
    model = tiny_llama(64)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(prefetch=0, gpu_memory_budget=1 << 30))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    manager.after_forward()  # the first step fixes the order and applies the budget: everything fits
    assert manager.stats().kept_resident_bytes > 0 and not any(unit.streams for unit in manager.units)
    counts = count_unit_copies(manager)
    before = manager.stats().h2d_bytes
    rollout(model, [[1, 2, 3, 4], [7, 8]])
    assert sum(counts.values()) == 0 and manager.stats().h2d_bytes == before


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_sampling_is_seeded_and_top_p_keeps_to_the_nucleus(top_p: float) -> None:
    model = tiny_llama(64)
    draw = [
        generate(
            model,
            PROMPTS,
            max_new_tokens=8,
            temperature=1.0,
            top_p=top_p,
            device=CPU,
            generator=torch.Generator().manual_seed(3),
        ).ids
        for _ in range(2)
    ]
    assert torch.equal(draw[0], draw[1])


def test_no_prompt_or_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        generate(tiny_llama(64), [[1], []], max_new_tokens=2, temperature=1.0, device=CPU)


@pytest.mark.gpu
def test_offloaded_generation_on_the_gpu_gives_the_resident_models_tokens_copying_once_per_step() -> None:
    import copy

    cuda = torch.device("cuda")
    model = tiny_llama(64)
    resident = copy.deepcopy(model).to(cuda)
    manager = OffloadTrainingManager(model, "cuda", options=OffloadOptions(prefetch=1))
    counts = count_unit_copies(manager)
    prompts = [[1, 2, 3, 4], [7, 8], [3, 3, 3], [9]] * 4  # 16 rows, as 2 prompts x G = 8
    ours = generate(model, prompts, max_new_tokens=12, temperature=0, device=cuda)
    theirs = generate(resident, prompts, max_new_tokens=12, temperature=0, device=cuda)
    assert torch.equal(ours.ids, theirs.ids) and ours.forwards == 12
    assert set(counts.values()) == {12}  # each unit once per decode step for all 16 rows


def count_host_syncs(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The device-to-host reads (``bool``, ``item``, ``tolist``, ``int``) from here on, by the file that makes them:
    each one waits on a GPU for every kernel queued before it."""
    import sys

    counts: Counter[str] = Counter()
    for name in ("__bool__", "item", "tolist", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _original: Any = original) -> Any:
            counts[sys._getframe(1).f_code.co_filename.rsplit("/", 1)[-1]] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def test_the_decode_loop_waits_for_the_device_every_few_steps_not_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs.objectives import generation

    STOP_CHECK_EVERY = getattr(generation, "STOP_CHECK_EVERY", 8)
    model = tiny_llama(64)
    syncs = count_host_syncs(monkeypatch)
    steps = 4 * STOP_CHECK_EVERY
    out = generate(model, PROMPTS, max_new_tokens=steps, temperature=1.0, stops=frozenset({63}), device=CPU)
    assert out.forwards == steps
    # ours: the stop checks (one per STOP_CHECK_EVERY steps, none at max_new_tokens) and the result's cut
    assert syncs["generation.py"] <= steps // STOP_CHECK_EVERY + 1
    # transformers' (whether a padded mask has padding): at the prefill only, not at each decode step
    assert sum(syncs.values()) - syncs["generation.py"] <= 2, syncs


def test_rows_that_all_stop_between_two_checks_end_where_the_last_one_stopped() -> None:
    model = tiny_llama(64).double()
    free = generate(model, PROMPTS, max_new_tokens=10, temperature=0, device=CPU).ids
    stops = frozenset(free[:, 1].tolist())  # every row stops at its second token
    out = generate(model, PROMPTS, max_new_tokens=10, temperature=0, stops=stops, device=CPU)
    kept = out.mask.sum(-1)
    assert out.ids.shape[1] == int(kept.max()) <= 2  # not the STOP_CHECK_EVERY steps the loop ran
