"""A memory budget with optimizer offload (plan.py, schedule.py): it first keeps the first trainable parameters
on the device with their optimizer (4 bytes of budget per byte of weight), so their updates leave the CPU;
what is left holds other trainable weights from their forward to their backward, so each is copied to the
device once a step instead of twice. Training is unchanged."""

from __future__ import annotations

import pytest
import torch

from offload import OffloadOptions, OffloadTrainingManager, plan_memory
from offload.plan import OPTIMIZER_ON_DEVICE_FACTOR
from tests.offload.models import Stack, make_stack, train


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _run(
    budget: int | None, checkpointing: str | None = None, attach: bool = False, device: str = "cpu", delayed=False
) -> tuple[list[float], dict, list[int], OffloadTrainingManager | None]:
    """Four AdamW steps of the full stack (``models.train``), and the bytes each step copied to the device;
    ``budget=-1``: no manager at all."""
    offload = None
    if budget != -1:
        offload = {"enable_optimizer_cpu_offload": True, "options": OffloadOptions(gpu_memory_budget=budget)}
    copied: list[int] = []

    def count(model: torch.nn.Module, manager: OffloadTrainingManager | None) -> None:
        if manager is not None:
            copied.append(manager.stats().last_step_h2d_bytes)  # the step's, set by after_backward

    losses, state, manager = train(
        make_stack("full", checkpointing),
        steps=4,
        offload=offload,
        device=device,
        between_steps=count,
        attach={"delayed_update": delayed, "warmup_steps": 1} if attach else None,
    )
    return losses, state, copied, manager


def _assert_same(got: tuple, expected: tuple) -> None:
    assert got[0] == expected[0]
    for name, value in expected[1].items():
        assert torch.equal(got[1][name], value), name


@pytest.mark.parametrize("attach", [False, True], ids=["optimizer-after", "attach_optimizer"])
def test_the_first_layers_stay_on_the_device_with_their_optimizer(attach: bool) -> None:
    block = _bytes(make_stack("full", None).blocks[0])
    expected = _run(-1)
    streamed = _run(None, attach=attach)
    kept = _run(OPTIMIZER_ON_DEVICE_FACTOR * block, attach=attach)  # room for block 0 and its optimizer, exactly
    _assert_same(streamed, expected)
    _assert_same(kept, expected)
    manager = kept[3]
    assert manager is not None
    # Block 0's weights never travel: not for its forward, nor for its backward (which reads its weights but
    # not its biases, and not its first norm's: the input needs no gradient).
    saved = {streamed[2][i] - kept[2][i] for i in range(4)}
    assert len(saved) == 1 and block < saved.pop() <= 2 * block
    assert manager.plan.device_trainable_bytes == OPTIMIZER_ON_DEVICE_FACTOR * block


def test_the_plan_and_the_manager_agree_on_what_stays() -> None:
    model = make_stack("full", None)
    options = OffloadOptions(gpu_memory_budget=OPTIMIZER_ON_DEVICE_FACTOR * _bytes(model.blocks[0]))
    plan = plan_memory(model, enable_optimizer_cpu_offload=True, options=options)
    assert plan.device_trainables == {id(p) for p in model.blocks[0].parameters()}
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, options=options)
    kinds = {name: manager._offloaders[id(p)].kind for name, p in model.named_parameters()}
    assert {n for n, k in kinds.items() if k == "always_on_device"} == {
        f"blocks.0.{n}" for n, _ in model.blocks[0].named_parameters()
    }
    assert (
        manager.plan.pinned_requested_bytes
        < plan_memory(model, enable_optimizer_cpu_offload=True).pinned_requested_bytes
    )
    manager.remove()


@pytest.mark.parametrize("attach", [False, True], ids=["optimizer-after", "attach_optimizer"])
def test_what_is_left_holds_trainables_from_forward_to_backward(attach: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for every weight once, none with its optimizer (an optimizer state too large for any of it): from
    step 2 on (the budget applies after step 1) each weight is copied once a step."""
    monkeypatch.setattr("offload.plan.OPTIMIZER_ON_DEVICE_FACTOR", 1 << 40)
    weights = _bytes(make_stack("full", None))
    expected = _run(-1)
    streamed = _run(None, attach=attach)
    held = _run(weights, attach=attach)
    _assert_same(held, expected)
    assert streamed[2][-1] > 1.5 * weights  # in forward and again for backward (less the last unit)
    assert held[2][0] == streamed[2][0] and held[2][1:] == [weights] * 3
    assert held[3] is not None and held[3]._schedule.held_for_backward_bytes == weights


def test_the_budget_holds_only_what_fits() -> None:
    model = make_stack("full", None)
    layer = _bytes(model.blocks[1].fc1)
    # Block 0 and its optimizer; of the fc1's worth left, what the prefix rule takes on the device (block 1's
    # norm), and the rest holds whatever else fits from the forward's end.
    options = OffloadOptions(gpu_memory_budget=OPTIMIZER_ON_DEVICE_FACTOR * _bytes(model.blocks[0]) + layer)
    _, _, manager = train(model, steps=2, offload={"enable_optimizer_cpu_offload": True, "options": options})
    assert manager is not None and 0 < manager._schedule.held_for_backward_bytes <= layer


def test_delayed_update_keeps_the_device_parameters_exact() -> None:
    """Under delayed_update the CPU's parameters are one step stale; those on the device are updated in
    optimizer.step() itself, exactly: with every parameter there, training equals the plain loop."""
    everything = OPTIMIZER_ON_DEVICE_FACTOR * _bytes(make_stack("full", None))
    _assert_same(_run(everything, attach=True, delayed=True), _run(-1))


def test_a_checkpointed_forward_saves_no_weights_so_nothing_is_held_across_it() -> None:
    """Under checkpointing the backward's recompute copies again whatever the budget says; training is
    still exact."""
    block, rest = _bytes(Stack().blocks[0]), _bytes(Stack()) - _bytes(Stack().blocks[0])
    _assert_same(_run(OPTIMIZER_ON_DEVICE_FACTOR * block + rest, "non_reentrant"), _run(-1, "non_reentrant"))


def test_auto_keeps_no_trainable_on_the_device() -> None:
    """'auto' is measured after the optimizer has made its state: too late to choose where it lives."""
    model = make_stack("full", None)
    plan = plan_memory(model, enable_optimizer_cpu_offload=True, options=OffloadOptions(gpu_memory_budget="auto"))
    assert plan.device_trainables == frozenset()


@pytest.mark.gpu
@pytest.mark.parametrize("attach", [False, True], ids=["optimizer-after", "attach_optimizer"])
def test_the_split_optimizer_trains_like_the_resident_one_on_gpu(attach: bool) -> None:
    """Block 0 updated by the GPU's AdamW, the rest by the CPU's: within fp32 tolerance of resident training
    (the two kernels round differently); held trainables change nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run `pytest -m gpu` on a GPU box")
    model = make_stack("full", None)
    block, rest = _bytes(model.blocks[0]), _bytes(model) - _bytes(model.blocks[0])
    resident = _run(-1, device="cuda")
    split = _run(OPTIMIZER_ON_DEVICE_FACTOR * block + rest, attach=attach, device="cuda")
    assert split[3] is not None and split[3].plan.device_trainable_bytes >= OPTIMIZER_ON_DEVICE_FACTOR * block
    for a, b in zip(split[0], resident[0], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b))
    for name, value in resident[1].items():
        torch.testing.assert_close(split[1][name], value, rtol=1e-4, atol=1e-5)
    assert split[3]._schedule.held_for_backward_bytes > 0
