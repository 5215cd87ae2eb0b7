"""Outside its unit's forward and backward a frozen parameter holds no device storage.

With ``prefetch=0`` this holds strictly. With the defaults two deliberate exceptions are bounded: the next
``prefetch`` units are copied while the current one computes, and the last unit of forward stays for the
start of backward. Between steps nothing is resident either way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadOptions, OffloadTrainingManager, StaticParamOffloader
from tests.offload.models import WIDTH, make_stack

OPTIONS = [
    pytest.param(OffloadOptions(prefetch=0), id="prefetch0"),
    pytest.param(OffloadOptions(), id="default"),
    pytest.param(OffloadOptions(granularity="block", prefetch=1), id="block"),
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_frozen_weights_are_resident_only_around_their_unit(checkpointing: str | None, options: OffloadOptions) -> None:
    model = make_stack("adapter", checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=options)
    frozen = [o for o in manager._offloaders.values() if isinstance(o, StaticParamOffloader)]
    hosts = {o.name: o.host.data_ptr() for o in frozen}
    extra_units: list[int] = []

    def check_forward(module: torch.nn.Module, args: tuple) -> None:
        if torch._C._current_graph_task_id() != -1 or manager._schedule.recording:
            return  # a checkpoint recompute keeps its region for the backward that follows
        mine = {id(manager._schedule.unit_of[id(manager._offloaders[id(p)])]) for p in module.parameters()}
        others = {id(manager._schedule.unit_of[id(o)]) for o in frozen if o.resident} - mine
        extra_units.append(len(others))

    for module in model.modules():
        if not list(module.children()):
            module.register_forward_pre_hook(check_forward)
    for step in range(3):
        x = torch.randn(8, WIDTH)
        loss = F.mse_loss(model(x), x + 1)
        resident = [o for o in frozen if o.resident]
        if options.prefetch == 0 or step == 0:
            assert resident == []
            assert all(o.tensor.data_ptr() == hosts[o.name] for o in frozen)
        else:  # only the last unit of forward, kept for the first node of backward
            assert {id(manager._schedule.unit_of[id(o)]) for o in resident} <= {id(manager._schedule.order[-1])}
        loss.backward()
        assert [o.name for o in frozen if o.resident] == []
        manager.after_backward()
        assert manager.stats().device_bytes == sum(
            o.nbytes for o in manager._offloaders.values() if o.kind == "always_on_device"
        )
    bound = 0 if options.prefetch == 0 else options.prefetch + 1  # + the unit kept from the last forward
    assert max(extra_units) <= bound


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
