"""A job of several GPUs on Ray: one placement group that reserves all its GPUs on one node (STRICT_PACK),
its actor placed in it. A local Ray instance with two logical GPUs stands in for a GPU node; the actor only
reports what Ray gave it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from service.workers.executor.ray_executor import rank_bundles  # noqa: E402


@pytest.fixture(scope="module")
def two_gpus() -> Iterator[None]:
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2**20)
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
class Where:
    def gpus(self) -> list[Any]:
        return ray.get_gpu_ids()


def test_rank_bundles_hold_every_gpu_in_one_bundle() -> None:
    assert rank_bundles(4, 8) == [{"GPU": 4.0, "CPU": 8.0}]


def test_a_two_gpu_actor_gets_both_gpus_of_one_node(two_gpus: None) -> None:
    group = placement_group(rank_bundles(2, 1), strategy="STRICT_PACK", name="ferry-test")
    ray.get(group.ready(), timeout=60)
    table = placement_group_table(group)
    assert table["strategy"] == "STRICT_PACK" and table["bundles"] == {0: {"GPU": 2.0, "CPU": 1.0}}
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    actor = Where.options(num_gpus=2, num_cpus=1, scheduling_strategy=strategy).remote()
    assert sorted(int(g) for g in ray.get(actor.gpus.remote(), timeout=60)) == [0, 1]
    ray.kill(actor)
    remove_placement_group(group)
