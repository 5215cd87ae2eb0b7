"""Outside its unit's forward and backward a frozen parameter holds no device storage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadTrainingManager, StaticParamOffloader
from tests.offload.models import WIDTH, make_stack


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_only_the_running_unit_is_resident(checkpointing: str | None) -> None:
    model = make_stack("adapter", checkpointing)
    manager = OffloadTrainingManager(model, "cpu")
    frozen = [o for o in manager._offloaders.values() if isinstance(o, StaticParamOffloader)]
    hosts = {o.name: o.host.data_ptr() for o in frozen}
    violations: list[str] = []

    def check_forward(module: torch.nn.Module, args: tuple) -> None:
        # Before each leaf's forward, frozen weights of other leaves must not be resident (during
        # the first forward; a checkpoint recompute keeps its region for the backward that follows).
        if torch._C._current_graph_task_id() != -1:
            return
        mine = {id(p) for p in module.parameters()}
        violations.extend(o.name for o in frozen if o.resident and id(o.tensor) not in mine)

    for module in model.modules():
        if not list(module.children()):
            module.register_forward_pre_hook(check_forward)
    for _ in range(2):
        x = torch.randn(8, WIDTH)
        loss = F.mse_loss(model(x), x)
        # Between forward and backward: every frozen weight is back on its host copy.
        assert [o.name for o in frozen if o.resident] == []
        assert all(o.tensor.data_ptr() == hosts[o.name] for o in frozen)
        loss.backward()
        assert [o.name for o in frozen if o.resident] == []
        manager.after_backward()
        assert manager.stats().device_bytes == sum(
            o.nbytes for o in manager._offloaders.values() if o.kind == "always_on_device")
    assert violations == []


def test_remove_leaves_an_ordinary_cpu_model_with_trained_values() -> None:
    model = make_stack("full", None)
    names = [n for n, _ in model.named_parameters()]
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(8, WIDTH)
    F.mse_loss(model(x), x).backward()
    manager.after_backward()
    optimizer.step()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    manager.remove()
    assert [n for n, _ in model.named_parameters()] == names
    for name, param in model.named_parameters():
        assert param.device.type == "cpu" and not param.is_pinned()
        assert torch.equal(param, trained[name])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    host_ptrs = {p.data_ptr() for p in model.parameters()}
    assert len(host_ptrs) == len(names)  # each parameter owns its own ordinary storage again
    model(x)  # plain forward works without the manager
