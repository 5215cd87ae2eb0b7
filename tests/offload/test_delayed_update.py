"""The delayed parameter update (``attach_optimizer(..., delayed_update=True)``): after the warm-up steps,
step t's update is applied when step t+2 first reads the weights. Checked bitwise against the same schedule
written as a plain loop, and its loss curve against exact training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from offload import OffloadTrainingManager
from tests.offload.models import WIDTH, make_stack


def delayed_by_hand(
    steps: int, warmup: int, checkpointing: str | None, device: str = "cpu"
) -> tuple[list[float], dict]:
    """The schedule without the engine: exact for ``warmup`` steps, then step s's gradient is applied just
    before step s+2's forward (so step s+1 still runs on the weights from before it)."""
    model = make_stack("full", checkpointing).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    held: list[list[torch.Tensor | None]] = []
    losses = []

    def apply(grads: list[torch.Tensor | None]) -> None:
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad()

    for step in range(steps):
        if step >= warmup + 2:
            apply(held.pop(0))
        x = torch.randn(8, WIDTH, generator=generator).to(device)
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        losses.append(loss.item())
        if step < warmup:
            optimizer.step()
            optimizer.zero_grad()
        else:
            held.append([p.grad for p in model.parameters()])
            optimizer.zero_grad()
    for grads in held:
        apply(grads)
    return losses, {k: v.to("cpu").clone() for k, v in model.state_dict().items()}


def delayed_by_engine(
    steps: int, warmup: int, checkpointing: str | None, delayed: bool = True, lr: float = 1e-2, device: str = "cpu"
) -> tuple[list, dict]:
    model = make_stack("full", checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    manager = OffloadTrainingManager(model, device, enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, delayed_update=delayed, warmup_steps=warmup)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, WIDTH, generator=generator).to(device)
        loss = F.mse_loss(model(x), x + 1)
        loss.backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    manager.remove()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_delayed_update_is_the_one_step_stale_schedule_bitwise(warmup: int, checkpointing: str | None) -> None:
    reference_losses, reference = delayed_by_hand(8, warmup, checkpointing)
    losses, state = delayed_by_engine(8, warmup, checkpointing)
    assert losses == reference_losses
    for name in reference:
        assert torch.equal(state[name], reference[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_delayed_update_follows_the_schedule_on_gpu(checkpointing: str | None) -> None:
    """On a GPU the copies and the CPU updates run concurrently for real; the result must still be the
    schedule (close, not bitwise: the reference steps AdamW on the GPU)."""
    reference_losses, reference = delayed_by_hand(12, 2, checkpointing, device="cuda")
    losses, state = delayed_by_engine(12, 2, checkpointing, device="cuda")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-4, atol=1e-5)
    for name in reference:
        torch.testing.assert_close(state[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)


def test_warmup_steps_are_exact() -> None:
    exact_losses, _ = delayed_by_engine(6, 0, None, delayed=False)
    losses, _ = delayed_by_engine(6, 4, None)
    assert losses[:5] == exact_losses[:5]  # step 4 still reads the weights of exact step 3's update
    assert losses[5] != exact_losses[5]


def test_delayed_loss_curve_tracks_exact_training() -> None:
    exact, _ = delayed_by_engine(100, 0, None, delayed=False, lr=1e-3)
    delayed, _ = delayed_by_engine(100, 5, None, lr=1e-3)
    tail_exact, tail_delayed = sum(exact[-10:]) / 10, sum(delayed[-10:]) / 10
    assert tail_exact < exact[0] / 3  # it learns
    assert abs(tail_delayed - tail_exact) / tail_exact < 0.02  # measured: 0.8%


def test_a_checkpoint_read_finishes_the_pending_updates() -> None:
    model = make_stack("full", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, delayed_update=True, warmup_steps=0)
    for _ in range(2):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    before = {k: v.clone() for k, v in model.named_parameters()}
    state = model.state_dict()  # publishes both pending updates
    assert all(not torch.equal(state[k], before[k]) for k in before)
    assert all(int(s["step"]) == 2 for s in optimizer.state_dict()["state"].values())
    manager.remove()


def test_the_copy_engine_not_the_cpu_fills_the_spare_copy() -> None:
    """A delayed update starts from the published weights in the spare host copy: the device copy that the
    step's read makes is copied back into it (the link carries it; the CPU only runs the optimizer)."""
    model = make_stack("full", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    manager.attach_optimizer(optimizer, delayed_update=True, warmup_steps=1)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    d2h = []
    for _ in range(5):
        x = torch.randn(8, WIDTH)
        F.mse_loss(model(x), x + 1).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        d2h.append(manager.stats().last_step_d2h_bytes)
    stepper = manager._stepper
    assert stepper is not None and stepper.cpu_copies == 0
    # Exact steps send the gradients back; delayed steps (after the first held one) the weights too.
    assert d2h[0] == weight_bytes
    assert d2h[3] == d2h[4] == 2 * weight_bytes
    manager.remove()  # the held updates have no device read: the CPU copies those
    assert stepper.cpu_copies > 0


def test_the_worker_runs_its_own_thread_count() -> None:
    model = make_stack("full", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    before = torch.get_num_threads()
    manager.attach_optimizer(optimizer, cpu_threads=1)
    seen = []
    stepper = manager._stepper
    assert stepper is not None
    original = stepper._step_together
    stepper._step_together = lambda batch: (seen.append(torch.get_num_threads()), original(batch))  # type: ignore[method-assign]
    x = torch.randn(8, WIDTH)
    F.mse_loss(model(x), x + 1).backward()
    manager.after_backward()
    optimizer.step()
    manager.wait_for_optimizer()
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before  # the training loop keeps its own
    manager.remove()
    other = make_stack("full", None)
    with pytest.raises(ValueError, match="cpu_threads must be >= 1; got 0"):
        OffloadTrainingManager(other, "cpu", enable_optimizer_cpu_offload=True).attach_optimizer(
            torch.optim.AdamW(other.parameters()), cpu_threads=0
        )
