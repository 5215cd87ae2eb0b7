"""GRPO's decode loop under model offload with a memory limit: the units the training budget streams stay on the
device for the whole loop when they fit beside the KV cache (copied once, not once per decode step), and stream
per step when they do not; the completions are the same either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from jobs.objectives.generation import generate
from jobs.objectives.grpo import GRPOLoss
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.llm_helpers import tiny_llama
from tests.jobs.objectives.test_generation import grpo

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4], [7, 8], [3, 3, 3]]  # x 4 completions: 12 rows
NEW = 6


def limited(**options: Any) -> tuple[torch.nn.Module, OffloadTrainingManager]:
    model = tiny_llama(64).requires_grad_(False)  # frozen, as a LoRA job's base: every weight streams
    options = {"granularity": "block", "gpu_memory_limit": "2GiB", **options}
    return model, OffloadTrainingManager(model, "cpu", options=OffloadOptions(**options))


def sample(model: torch.nn.Module, loss: GRPOLoss) -> list[str]:
    rows = [{"prompt": "p", "answer": "a"}] * len(PROMPTS)
    generator = torch.Generator().manual_seed(7)
    return loss.rollout(model, PROMPTS, rows, stops=frozenset(), pad_id=0, device=CPU, generator=generator).completions


def grpo_loss(hold: Any = None) -> GRPOLoss:
    return GRPOLoss(grpo(max_new_tokens=NEW), lambda c, r: [0.0] * len(c), lambda ids: " ".join(map(str, ids)),
                    hold_weights=hold)  # fmt: skip


def ring_placements(manager: OffloadTrainingManager) -> list[int | None]:
    """Where each streamed tensor and each block's span copies to: its ring slot, by identity (None: memory of
    its own)."""
    offloaders = [o for unit in manager.units for o in unit.offloaders]
    places = [o.placement for o in offloaders] + [o.group.placement for o in offloaders if o.group is not None]
    return [None if place is None else id(place) for place in places]


def copied(manager: OffloadTrainingManager) -> int:
    stats = manager.stats()
    return stats.h2d_bytes + stats.reused_bytes  # a ring slot that still held the weights counts as reused


def test_units_that_fit_the_limit_are_copied_once_for_the_whole_decode_loop() -> None:
    streamed_model, streamed_manager = limited()
    streamed_bytes = sum(unit.streamed_bytes for unit in streamed_manager.units)
    before = copied(streamed_manager)
    streamed = sample(streamed_model, grpo_loss())
    assert copied(streamed_manager) - before == NEW * streamed_bytes  # the old way: every unit, every decode step

    model, manager = limited()
    loss = grpo_loss(manager.hold_for_inference)
    before = copied(manager)
    placements = ring_placements(manager)
    held = sample(model, loss)
    assert ring_placements(manager) == placements  # every unit streams through its own ring slot again
    assert copied(manager) - before == streamed_bytes  # one load of the streamed units for all NEW decode steps
    assert held == streamed  # the same seed samples the same completions
    assert loss.take_metrics()["generation_units_kept"] == len(manager.units)
    # afterwards every unit streams again, through its ring slot, and nothing stays on the device
    assert all(unit.streams and not unit.resident for unit in manager.units)
    assert manager.stats().device_bytes == streamed_manager.stats().device_bytes


def test_units_that_do_not_fit_beside_the_decode_loops_memory_still_stream_every_step() -> None:
    model, manager = limited()
    streamed_bytes = sum(unit.streamed_bytes for unit in manager.units)
    no_room = 2 << 30  # the loop's own memory takes the whole limit
    loss = grpo_loss(lambda working: manager.hold_for_inference(working + no_room))
    before = copied(manager)
    held = sample(model, loss)
    assert copied(manager) - before == NEW * streamed_bytes
    assert loss.take_metrics()["generation_units_kept"] == 0
    reference_model, _ = limited()
    assert held == sample(reference_model, grpo_loss())


def test_the_hold_keeps_to_the_room_and_holds_some_units_when_not_all_fit() -> None:
    _model, manager = limited()
    with manager.hold_for_inference(0) as everything:
        pass
    room = everything.room
    assert room is not None and everything.units == len(manager.units)
    with manager.hold_for_inference(room - (everything.nbytes - 1)) as some:  # room for all but a byte
        assert 0 < some.units < len(manager.units) and some.nbytes < everything.nbytes
        assert "stream per decode step" in some.describe()
        assert all(not unit.streams for unit in manager.units if unit.resident)


def test_units_the_budget_keeps_are_left_as_they_are() -> None:
    model, manager = limited(gpu_memory_budget=1 << 30)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    manager.after_forward()  # the budget keeps every unit
    before = copied(manager)
    with manager.hold_for_inference(0) as hold:
        sample(model, grpo_loss())
    assert hold.streamed == 0 and hold.units == 0 and copied(manager) == before
    assert all(unit.resident and not unit.streams for unit in manager.units)


def lora_grpo_steps(hold: bool, steps: int = 3) -> tuple[list[float], list[list[str]], dict[str, torch.Tensor]]:
    """LoRA GRPO steps through the runner's train_step under a limit, the decode loop holding the weights or not:
    the losses, the completions and the adapters after."""
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    from jobs.train.runner import train_step

    model = get_peft_model(
        tiny_llama(64), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_limit="2GiB"))
    rewards = lambda completions, rows: [float(len(c) % 3) for c in completions]  # noqa: E731 (varied: advantages)
    loss_fn = GRPOLoss(grpo(max_new_tokens=NEW), rewards, lambda ids: " ".join(map(str, ids)),
                       hold_weights=manager.hold_for_inference if hold else None)  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    generator = torch.Generator().manual_seed(3)
    rows = [{"prompt": "p", "answer": "a"}] * len(PROMPTS)
    losses, completions = [], []
    for _ in range(steps):
        rollout = loss_fn.rollout(model, PROMPTS, rows, stops=frozenset({5}), pad_id=0, device=CPU, generator=generator)
        loss = train_step(model, loss_fn, [rollout.batch], optimizer=optimizer, scheduler=scheduler,
                          accelerator=Accelerator(cpu=True), manager=manager, max_grad_norm=None, device=CPU)  # fmt: skip
        losses.append(float(loss))
        completions.append(rollout.completions)
    kept = loss_fn.take_metrics().get("generation_units_kept")
    assert kept == (steps * 6 if hold else None)  # all 6 streamed units (embedding, 2 layers, norm, rotary, head)
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    return losses, completions, adapters


def test_lora_grpo_steps_are_the_same_whether_generation_holds_the_weights_or_streams_them() -> None:
    held, streamed = lora_grpo_steps(hold=True), lora_grpo_steps(hold=False)
    assert held[0] == streamed[0] and held[1] == streamed[1]
    assert all(torch.equal(held[2][name], streamed[2][name]) for name in streamed[2])


@pytest.mark.gpu
def test_on_the_gpu_held_generation_gives_the_resident_models_tokens_copying_each_unit_once() -> None:
    import copy

    cuda = torch.device("cuda")
    model = tiny_llama(64).requires_grad_(False)
    resident = copy.deepcopy(model).to(cuda)
    manager = OffloadTrainingManager(
        model, "cuda", options=OffloadOptions(granularity="block", gpu_memory_limit="8GiB")
    )
    streamed_bytes = sum(unit.streamed_bytes for unit in manager.units)
    prompts = [[1, 2, 3, 4], [7, 8], [3, 3, 3], [9]] * 4  # 16 rows, as 2 prompts x G = 8
    before = copied(manager)
    with manager.hold_for_inference(0) as hold:
        ours = generate(model, prompts, max_new_tokens=12, temperature=0, device=cuda)
    theirs = generate(resident, prompts, max_new_tokens=12, temperature=0, device=cuda)
    assert hold.units == len(manager.units) and torch.equal(ours.ids, theirs.ids)
    assert copied(manager) - before == streamed_bytes
    assert manager.stats().device_bytes == 0  # all dropped again


def test_the_kv_cache_estimate_is_the_size_of_transformers_cache() -> None:
    from transformers import DynamicCache

    from jobs.objectives.generation_memory import decode_memory_bytes, kv_cache_bytes

    model = tiny_llama(64)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.ones((3, 7), dtype=torch.long), past_key_values=cache, use_cache=True)
    real = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_cache_bytes(model.config, rows=3, positions=7, element_size=4) == real
    assert decode_memory_bytes(model, rows=3, prompt_width=4, max_new_tokens=3) > real  # and the working memory
