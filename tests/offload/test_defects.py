"""Each defect of the reference implementation, fixed and tested (shared/design/offload-engine.md, section 2)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import OffloadOptions, OffloadTrainingManager, StaticParamOffloader
from tests.offload.models import WIDTH, make_stack, train


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def frozen_resident(manager: OffloadTrainingManager) -> list[str]:
    return [o.name for o in manager._offloaders.values() if isinstance(o, StaticParamOffloader) and o.resident]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def test_batchnorm_running_statistics_match_plain_training() -> None:
    def run(offload: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = ConvNet()
        manager = OffloadTrainingManager(model, "cpu") if offload else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            if manager:
                manager.after_backward()
            optimizer.step()
            optimizer.zero_grad()
        if manager:
            manager.remove()
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain, offloaded = run(False), run(True)
    assert plain["bn.num_batches_tracked"].item() == 4
    assert not torch.equal(plain["bn.running_mean"], torch.zeros(8))
    assert_states_equal(plain, offloaded)


def test_no_grad_evaluation_between_steps_leaves_no_weight_resident() -> None:
    seen: list[list[str]] = []

    def evaluate(model: nn.Module, manager: OffloadTrainingManager | None) -> None:
        with torch.no_grad():
            for _ in range(50):
                model(torch.randn(8, WIDTH))
        seen.append(frozen_resident(manager))

    for checkpointing in (None, "non_reentrant"):
        model = make_stack("adapter", checkpointing)
        train(model, offload={}, between_steps=evaluate, steps=3)
    assert seen == [[]] * 6


class TwiceAndShared(nn.Module):
    """A module called twice in one forward, a weight shared by two modules, and a parameter of a
    non-leaf module used in its parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.Linear(WIDTH, WIDTH)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.b.weight = self.a.weight  # tied
        self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH))
        self.inner.scale = nn.Parameter(torch.ones(WIDTH))  # owned by a non-leaf module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.twice(self.twice(x).relu())
        x = self.b(self.a(x).tanh())
        return self.inner(x) * self.inner.scale  # the parent uses the child's parameter directly


@pytest.mark.parametrize(
    "offload", [{}, {"enable_optimizer_cpu_offload": True}], ids=["gpu-optimizer", "cpu-optimizer"]
)
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-twice"])
def test_module_called_twice_shared_and_orphan_parameters_train_correctly(offload: dict, frozen: bool) -> None:
    def make() -> TwiceAndShared:
        torch.manual_seed(0)
        model = TwiceAndShared()
        if frozen:
            model.twice.requires_grad_(False)
        return model

    ref_losses, ref_state, _ = train(make())
    losses, state, manager = train(make(), offload=offload)
    assert losses == ref_losses
    assert_states_equal(ref_state, state)
    model = make()
    manager = OffloadTrainingManager(model, "cpu", **offload)
    assert len({id(o) for o in manager._offloaders.values()}) == len(list(model.parameters()))


class InPlaceOnOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        y.add_(1.0).relu_()  # in-place ops on a unit's output
        return self.fc2(y)


def test_in_place_op_on_a_unit_output_works() -> None:
    def make() -> InPlaceOnOutput:
        torch.manual_seed(0)
        model = InPlaceOnOutput()
        model.fc1.requires_grad_(False)
        return model

    ref_losses, ref_state, _ = train(make())
    losses, state, _ = train(make(), offload={})
    assert losses == ref_losses
    assert_states_equal(ref_state, state)


def test_in_place_modification_of_a_saved_activation_is_still_detected() -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Sigmoid())
    OffloadTrainingManager(model, "cpu")
    out = model(torch.randn(2, WIDTH))
    out.mul_(2)  # sigmoid saved its output; autograd must refuse as it does without offload
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("method", ["full", "adapter"])
def test_gradient_accumulation_with_optimizer_offload_equals_plain(method: str) -> None:
    ref_losses, ref_state, _ = train(make_stack(method, None), micro_batches=4)
    losses, state, _ = train(make_stack(method, None), micro_batches=4, offload={"enable_optimizer_cpu_offload": True})
    assert losses == ref_losses
    assert_states_equal(ref_state, state)


def test_gradient_accumulation_with_after_backward_every_micro_batch() -> None:
    """accelerate's pattern: after_backward after each micro-batch, step and zero_grad every 4th."""

    def run(offload: bool) -> dict[str, torch.Tensor]:
        model = make_stack("full", None)
        manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True) if offload else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(3)
        for micro in range(8):
            x = torch.randn(8, WIDTH, generator=generator)
            (F.mse_loss(model(x), x) / 4).backward()
            if manager:
                manager.after_backward()
            if micro % 4 == 3:
                optimizer.step()
                optimizer.zero_grad()
        if manager:
            manager.remove()
        return {k: v.clone() for k, v in model.state_dict().items()}

    assert_states_equal(run(False), run(True))


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize(
    "options", [OffloadOptions(), OffloadOptions(granularity="block", prefetch=2)], ids=["leaf", "block"]
)
def test_each_frozen_weight_is_copied_at_most_twice_per_step(
    checkpointing: str | None, options: OffloadOptions
) -> None:
    """Forward once, backward (or its recompute) once. With whole-block copies that also means one copy
    per block each way: a block is not copied again for each of its tensors."""
    model = make_stack("adapter", checkpointing)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    manager = OffloadTrainingManager(model, "cpu", options=options)
    # One copy per pass for a whole block, one per streamed tensor for any other unit.
    blocks = options.granularity == "block"
    per_pass = sum(
        1 if blocks and unit.name.startswith("blocks.") else sum(o.kind != "always_on_device" for o in unit.offloaders)
        for unit in manager.units
    )
    onloads = manager.stats().onloads  # the adapters' one-time moves to the device
    reused = 0
    for _ in range(3):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x).backward()
        manager.after_backward()
        stats = manager.stats()
        # Copied, or reused from a ring slot that still held it (test_ring_reuse.py); pinned_requested_bytes:
        # the frozen weights plus the arena's alignment padding inside block spans.
        needed = stats.last_step_h2d_bytes + stats.reused_bytes - reused
        assert frozen_bytes < needed <= 2 * stats.pinned_requested_bytes
        assert stats.onloads - onloads <= 2 * per_pass
        onloads, reused = stats.onloads, stats.reused_bytes


def test_trainable_weights_are_never_copied_device_to_host() -> None:
    model = make_stack("full", "non_reentrant")
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        # Only gradients travel back: exactly one gradient per parameter per step.
        assert manager.stats().last_step_d2h_bytes == grad_bytes


def test_forward_that_raises_leaves_nothing_resident_and_hooks_balanced() -> None:
    model = make_stack("adapter", None)
    manager = OffloadTrainingManager(model, "cpu")
    with pytest.raises(RuntimeError):
        model(torch.randn(8, WIDTH + 1))
    assert frozen_resident(manager) == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x = torch.randn(8, WIDTH)
    F.mse_loss(model(x), x).backward()  # still trains afterwards
    manager.after_backward()


def test_model_copy_is_independent_after_remove() -> None:
    model = make_stack("full", None)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.remove()
    clone = copy.deepcopy(model)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), clone.state_dict().values(), strict=False)
    )


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_no_reference_cycles_keep_checkpoint_inputs_alive(granularity: str) -> None:
    """Saved-tensor hooks that referenced themselves kept checkpointing's frames (and every block input they
    save) alive until the garbage collector ran: gigabytes of activations at 16k tokens."""
    import gc

    from offload import OffloadOptions

    model = make_stack("adapter", "non_reentrant")
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity=granularity))
    x = torch.randn(8, WIDTH)
    F.mse_loss(model(x), x).backward()
    manager.after_backward()
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            F.mse_loss(model(x), x).backward()
            manager.after_backward()
        alive = [o for o in gc.get_objects() if type(o).__name__ == "_CheckpointFrame"]
    finally:
        gc.enable()
    assert alive == []


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("method", ["full", "adapter"])
def test_optimizer_steps_during_backward_equal_a_normal_step(method: str, micro_batches: int) -> None:
    """attach_optimizer: each parameter's update runs on a CPU thread while backward continues."""

    def run(attach: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = make_stack(method, "non_reentrant")
        manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True) if attach else None
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        if manager:
            manager.attach_optimizer(optimizer, accumulation_steps=micro_batches)
        generator = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(3):
            for _ in range(micro_batches):
                x = torch.randn(8, WIDTH, generator=generator)
                loss = F.mse_loss(model(x), x + 1) / micro_batches
                loss.backward()
                if manager:
                    manager.after_backward()
                losses.append(loss.item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if manager:
            manager.remove()
        return losses, {k: v.clone() for k, v in model.state_dict().items()}

    plain_losses, plain = run(False)
    losses, state = run(True)
    assert losses == plain_losses
    assert_states_equal(plain, state)


def test_attach_optimizer_needs_optimizer_offload() -> None:
    model = make_stack("full", None)
    manager = OffloadTrainingManager(model, "cpu")
    with pytest.raises(ValueError, match="attach_optimizer needs enable_optimizer_cpu_offload=True"):
        manager.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_remove_without_copy_keeps_one_host_copy_of_the_weights() -> None:
    """A job's end removes the engine from a model that is dropped next: copying every host copy into memory
    of its own first put a second copy of the weights in host memory (64 GB more for a 32B model, which the
    OOM killer ended). ``remove(copy=False)`` leaves the tensors reading the host copies, with their values."""
    model = make_stack("adapter", None)
    manager = OffloadTrainingManager(model, "cpu")
    x = torch.randn(8, WIDTH)
    F.mse_loss(model(x), x).backward()
    manager.after_backward()
    hosts = {o.name: o.host for o in manager._offloaders.values() if type(o) is StaticParamOffloader}
    assert hosts
    manager.remove(copy=False)
    views = [name for name, tensor in model.named_parameters() if name in hosts]
    assert len(views) == len(hosts)
    for name in views:
        tensor = model.get_parameter(name)
        assert tensor.device.type == "cpu"
        assert tensor.data_ptr() == hosts[name].data_ptr(), name
    reference = copy.deepcopy(model)
    manager = OffloadTrainingManager(model, "cpu")
    manager.remove()  # the default still copies out: a model used on afterwards owns its memory
    for (name, tensor), (_, kept) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(tensor, kept), name
        if name in hosts:
            assert tensor.data_ptr() != hosts[name].data_ptr(), name
