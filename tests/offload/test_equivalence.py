"""The same seeded model trained with and without the manager: identical losses and weights (bitwise on CPU)."""

from __future__ import annotations

import pytest
import torch

from offload import OffloadOptions
from tests.offload.models import make_stack, train

CASES = [
    pytest.param("full", {}, id="full"),
    pytest.param("full", {"enable_optimizer_cpu_offload": True}, id="full-optimizer-offload"),
    pytest.param("adapter", {}, id="adapter"),
    pytest.param("adapter", {"enable_optimizer_cpu_offload": True}, id="adapter-optimizer-offload"),
    pytest.param("full", {"cpu_offload_split_threshold": 0.01}, id="full-split-threshold"),
    pytest.param(
        "adapter",
        {"cpu_offload_split_threshold": 0.005, "enable_optimizer_cpu_offload": True},
        id="adapter-split-threshold-optimizer-offload",
    ),
]
CHECKPOINTING = [None, "non_reentrant", "reentrant"]
# The fast path (default: side streams, prefetch, last unit kept), whole-block copies, and the seed's
# serialized behaviour must all train identically.
OPTIONS = [
    pytest.param({}, id="default"),
    pytest.param({"granularity": "block", "prefetch": 2}, id="block"),
    pytest.param({"prefetch": 0}, id="prefetch0"),
    pytest.param({"gpu_memory_budget": 20_000}, id="budget"),
]


def assert_same_training(
    method: str, offload: dict, checkpointing: str | None, device: str, exact: bool, options: dict
) -> None:
    ref_losses, ref_state, _ = train(make_stack(method, checkpointing), device=device)
    offload = {**offload, "options": OffloadOptions(**options)}
    losses, state, _ = train(make_stack(method, checkpointing), offload=offload, device=device)
    assert len(losses) == 5
    assert state.keys() == ref_state.keys()
    if exact:
        assert losses == ref_losses
        for name in ref_state:
            assert torch.equal(state[name], ref_state[name]), name
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for name in ref_state:
            torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize(("method", "offload"), CASES)
def test_offload_matches_plain_training_on_cpu(
    method: str, offload: dict, checkpointing: str | None, options: dict
) -> None:
    assert_same_training(method, offload, checkpointing, device="cpu", exact=True, options=options)


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize(("method", "offload"), CASES)
def test_offload_matches_plain_training_on_gpu(
    method: str, offload: dict, checkpointing: str | None, options: dict
) -> None:
    # The CPU optimizer (optimizer offload) and the GPU one round differently: close, not bitwise.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    assert_same_training(method, offload, checkpointing, device="cuda", exact=False, options=options)
