"""``optimizer_shard``: each engine holds and steps its part of every trainable weight (here two managers in one
process stand for two ranks that see the same rows, so no gradient needs averaging; the test copies each one's
updated parts into the other's masters, as the all-gather of a data-parallel job does after each step)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadTrainingManager, OptimizerShard, plan_memory
from tests.offload.models import WIDTH, make_stack

STEPS, MICRO_BATCHES = 3, 2


@pytest.mark.parametrize("numel", [1, 2, 5, 64, 91])
def test_the_parts_of_a_weight_cover_it_once_in_rank_order(numel: int) -> None:
    for world_size in (1, 2, 3, 4):
        parts = [OptimizerShard(rank, world_size).part(numel) for rank in range(world_size)]
        assert parts[0].start == 0 and parts[-1].stop == numel
        assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
        assert all(p.chunk == -(-numel // world_size) and 0 <= p.numel <= p.chunk for p in parts)


def run(managers: list[OffloadTrainingManager], models: list[torch.nn.Module], optimizers: list) -> list[int]:
    """``STEPS`` steps of ``MICRO_BATCHES`` micro-batches on every model; returns the step hooks' calls."""
    calls = [0] * len(managers)
    for index, manager in enumerate(managers):
        manager.register_step_hook(lambda index=index: calls.__setitem__(index, calls[index] + 1))
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        xs = [torch.randn(8, WIDTH, generator=generator) for _ in range(MICRO_BATCHES)]
        for model, manager, optimizer in zip(models, managers, optimizers, strict=True):
            for x in xs:
                (F.mse_loss(model(x), x + 1) / MICRO_BATCHES).backward()
                manager.after_backward()
            optimizer.step()
            optimizer.zero_grad()
        if len(managers) > 1:  # the all-gather: each master takes the other rank's updated part
            for mine, theirs in zip(managers, reversed(managers), strict=True):
                for (_, master, _), (_, other, part) in zip(mine.hosted_parts(), theirs.hosted_parts(), strict=True):
                    part.of(master).copy_(part.of(other))
    return calls


def test_two_halves_step_what_one_whole_steps_bit_for_bit() -> None:
    whole_model = make_stack("full", None)
    whole = OffloadTrainingManager(whole_model, "cpu", enable_optimizer_cpu_offload=True)
    whole_optimizer = torch.optim.AdamW(whole_model.parameters(), lr=1e-2, fused=True)
    whole.attach_optimizer(whole_optimizer, accumulation_steps=MICRO_BATCHES)
    assert run([whole], [whole_model], [whole_optimizer]) == [0]  # no shard: step hooks do not run

    models = [make_stack("full", None) for _ in range(2)]
    managers = [
        OffloadTrainingManager(m, "cpu", enable_optimizer_cpu_offload=True, optimizer_shard=OptimizerShard(r, 2))
        for r, m in enumerate(models)
    ]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in models]
    for manager, optimizer in zip(managers, optimizers, strict=True):
        manager.attach_optimizer(optimizer, accumulation_steps=MICRO_BATCHES)
    assert run(managers, models, optimizers) == [STEPS, STEPS]

    for (param, master, _), *halves in zip(whole.hosted_parts(), *(m.hosted_parts() for m in managers), strict=True):
        for (own, own_master, part), optimizer in zip(halves, optimizers, strict=True):
            assert torch.equal(own_master, master)  # every weight whole again, with the same bits
            state = optimizer.state[own]
            assert state["exp_avg"].shape == (part.numel,) == (param.numel() // 2,)
            assert torch.equal(state["exp_avg_sq"], part.of(whole_optimizer.state[param]["exp_avg_sq"]))
            assert own.grad is None  # the whole gradient is never on one rank
    trainable = sum(p.numel() * p.element_size() for p in whole_model.parameters())
    steps = 4 * len(list(whole_model.parameters()))  # AdamW's step count, a float32 scalar per weight
    assert whole.stats().optimizer_host_bytes == 2 * trainable + steps
    assert [m.stats().optimizer_host_bytes for m in managers] == [trainable + steps] * 2


def test_the_plan_sizes_each_gradient_buffer_to_the_part() -> None:
    model = make_stack("full", None)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    whole = plan_memory(model, enable_optimizer_cpu_offload=True)
    half = plan_memory(model, enable_optimizer_cpu_offload=True, optimizer_shard=OptimizerShard(1, 2))
    assert whole.pinned_requested_bytes - half.pinned_requested_bytes == trainable // 2
    shard = OptimizerShard(1, 2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, optimizer_shard=shard)
    assert manager.arena.requested_bytes == half.pinned_requested_bytes  # what the engine allocates


def test_a_shard_needs_the_cpu_optimizer_and_exact_updates() -> None:
    with pytest.raises(ValueError, match="optimizer_shard needs enable_optimizer_cpu_offload=True"):
        OffloadTrainingManager(make_stack("full", None), "cpu", optimizer_shard=OptimizerShard(0, 2))
    model = make_stack("full", None)
    shard = OptimizerShard(0, 2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, optimizer_shard=shard)
    with pytest.raises(ValueError, match="delayed_update cannot be combined with optimizer_shard"):
        manager.attach_optimizer(torch.optim.AdamW(model.parameters()), delayed_update=True)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        OptimizerShard(2, 2)
