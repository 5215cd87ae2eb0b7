"""Two gloo ranks split the CPU optimizer (ZeRO-1 under optimizer offload): each holds and steps its part of every
weight, the gradients reduce-scattered and the updated weights all-gathered, and together they train what one
process trains on the union of their rows. The weights are odd-sized, so parts are uneven and one is empty."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from jobs.distributed.gradients import GradientReducer
from jobs.distributed.optimizer_shards import OptimizerShards
from offload import OffloadTrainingManager, OptimizerShard

STEPS, ROWS = 3, 8
# Two ranks against one process: each gradient is the mean of two half-batch means instead of one batch's mean
# (another float32 summation order); the moments and weights then differ by a few ulps.
RTOL, ATOL = 1e-5, 1e-6


def model() -> nn.Module:
    torch.manual_seed(0)
    # 91 + 13, 65 + 5 and 5 + 1 elements: odd parts (46 and 45), and a bias of one element whose part on rank 1 is
    # empty.
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5), nn.GELU(), nn.Linear(5, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 7, generator=generator), torch.randn(ROWS, 1, generator=generator)


def train(rank: int = 0, world_size: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, OptimizerShards | None]:
    """``STEPS`` steps of this rank's rows ``rank::world_size`` (everything on one process)."""
    net = model()
    shard = OptimizerShard(rank, world_size) if world_size > 1 else None
    manager = OffloadTrainingManager(net, "cpu", enable_optimizer_cpu_offload=True, optimizer_shard=shard)
    if shard is not None:
        GradientReducer(net, manager, world_size=world_size, accumulation_steps=1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    shards = OptimizerShards(manager, optimizer) if shard is not None else None
    manager.attach_optimizer(optimizer)
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(net(x[rank::world_size]), y[rank::world_size]).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    manager.wait_for_optimizer()
    return net, optimizer, shards


def one_rank(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    try:
        net, optimizer, shards = train(rank, world_size)
        assert shards is not None
        torch.save(
            {
                "weights": {k: v.clone() for k, v in net.state_dict().items()},
                "state": {name: dict(optimizer.state[p]) for name, p in net.named_parameters()},
                "whole": shards.whole_state_dict(),
            },
            Path(out) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def on_two_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    mp.spawn(one_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def test_each_rank_steps_half_the_state_and_they_train_what_one_process_trains(tmp_path: Path) -> None:
    ranks = on_two_ranks(tmp_path)
    net, optimizer, _ = train()
    for index, (name, param) in enumerate(net.named_parameters()):  # the optimizer's order
        whole = optimizer.state[param]
        parts = [ranks[rank]["state"][name] for rank in range(2)]
        chunk = math.ceil(param.numel() / 2)
        # Rank 0 holds the first ceil(n/2) elements of each moment, rank 1 the rest: the actual state tensors.
        assert [p["exp_avg"].shape for p in parts] == [(chunk,), (param.numel() - chunk,)], name
        assert [p["exp_avg_sq"].numel() for p in parts] == [chunk, param.numel() - chunk], name
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(torch.cat([p[key] for p in parts]), whole[key].view(-1), rtol=RTOL, atol=ATOL)
            # The checkpoint's view: rank 0 gathers the parts into the weight's shape.
            assert_close(ranks[0]["whole"]["state"][index][key], whole[key], rtol=RTOL, atol=ATOL)
    held = [sum(p["exp_avg"].numel() for p in r["state"].values()) for r in ranks]
    total = sum(p.numel() for p in net.parameters())
    assert held == [93, 87] and sum(held) == total  # 46 + 7 + 33 + 3 + 3 + 1 and 45 + 6 + 32 + 2 + 2 + 0
    assert ranks[1]["whole"] is None
    for key, value in net.state_dict().items():
        assert torch.equal(ranks[0]["weights"][key], ranks[1]["weights"][key]), key  # gathered: the same bits
        assert_close(ranks[0]["weights"][key], value, rtol=RTOL, atol=ATOL)
