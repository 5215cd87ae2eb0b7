"""``training.profile``: where a training step's time goes, and the model FLOP utilization (MFU).

torch.profiler records a few steps; each kernel (on a GPU) or operator (on the CPU, by its own time) is put in one
of five classes by its name (``classify``): matrix multiplications, attention, the optimizer, and the rest; the time
the compute stream waited for the offload engine's copies comes from the engine's own count
(``OffloadStats.copy_wait_seconds``). Each is a share of the steps' wall time, and ``other`` is what the others
leave (kernels of other kinds, and time the device spent idle or waiting on the host).

The MFU counts the model's FLOPs, not the hardware's (a checkpointed layer's recompute is not counted), per step of
T tokens of sequences of S tokens:

    FLOPs = T * (4 * N + 2 * N_trainable) + T * 6 * L * d * S

where N is the number of weights in matrix multiplications (every ``nn.Linear``: the projections, the MLPs, the
LM head, LoRA's A and B; not the embedding table), N_trainable those of them that train: the forward's 2·N·T, the
backward's gradient of the activations 2·N·T and of the trainable weights 2·N_trainable·T (a full fine-tune is the
usual 6·N·T). The second term is causal attention's QKᵀ and PV over L layers of width d = heads x head size
(forward 2·S·d a token and layer, backward twice that), taken from a transformers config (``num_hidden_layers``,
``num_attention_heads``, ``head_dim`` or ``hidden_size``) and 0 for a model without one. The MFU is the achieved
FLOP/s over the device's dense peak for the compute dtype (``PEAK_TFLOPS``); on a device not listed (and on the
CPU) only the achieved rate is reported.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

CATEGORIES = ("matmul", "attention", "copy_wait", "optimizer", "other")
# Checked in this order: flash attention's kernels are built from GEMM pieces (cutlass), so attention goes first.
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa|scaled_dot_product|softmax_backward_data_attn", re.IGNORECASE)
_OPTIMIZER = re.compile(r"optimizer\.|adam|multi_tensor_apply|_foreach_|_fused_sgd|sgd_", re.IGNORECASE)
_MATMUL = re.compile(
    r"gemm|cublas|cutlass|nvjet|xmma|wgmma|triton_tem_fused_.*mm|^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm"
    r"|addmv|mv|dot)$",
    re.IGNORECASE,
)

# Dense peak TFLOP/s by device name (the first key found in torch.cuda.get_device_name()) and compute dtype: the
# vendors' figures without sparsity. fp32 matmuls run at the TF32 rate only if torch allows TF32.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def classify(name: str) -> str:
    """The class of a profiled kernel or operator, by its name: ``matmul``, ``attention``, ``optimizer`` or ``other``
    (``copy_wait`` is measured by the engine, not found in a name)."""
    if _ATTENTION.search(name):
        return "attention"
    if _OPTIMIZER.search(name):
        return "optimizer"
    if _MATMUL.search(name):
        return "matmul"
    return "other"


def seconds_by_class(timed: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Seconds per class (``classify``) of ``(name, seconds)`` pairs, every class present (0 where none)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for name, seconds in timed:
        totals[classify(name)] += seconds
    return totals


def matmul_weights(model: nn.Module) -> tuple[int, int]:
    """(N, N_trainable): the weights of ``model``'s ``nn.Linear`` modules, and those that train (a shared weight
    counts once per module that multiplies by it)."""
    total = trainable = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            numel = module.weight.numel()
            total += numel
            trainable += numel if module.weight.requires_grad else 0
    return total, trainable


def attention_width(model: nn.Module) -> tuple[int, int]:
    """(L, d) of a transformers config reachable from ``model`` (peft keeps it on the base); (0, 0) without one."""
    config = getattr(model, "config", None)
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    if not isinstance(layers, int) or not isinstance(heads, int):
        return 0, 0
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    return layers, heads * int(head_dim)


def training_flops(model: nn.Module, tokens: int, seq_len: int) -> int:
    """A step's model FLOPs for ``tokens`` tokens in sequences of ``seq_len`` (module docstring's formula)."""
    n, n_trainable = matmul_weights(model)
    layers, width = attention_width(model)
    return tokens * (4 * n + 2 * n_trainable) + tokens * 6 * layers * width * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for matmuls in ``dtype``; None for the CPU or a device not in ``PEAK_TFLOPS``."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    rates = next((r for key, r in PEAK_TFLOPS.items() if key in name), None)
    if rates is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        key = "bf16"
    else:
        key = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return rates[key] * 1e12


@dataclass
class ProfileReport:
    """What the profiled steps spent their time on, and how fast they computed."""

    steps: list[int]
    step_s: float  # mean wall time of a profiled step
    shares: dict[str, float]  # class -> share of the steps' wall time (sums to 1)
    flops_per_step: int
    peak_flops: float | None
    device: str

    @property
    def achieved_flops(self) -> float:
        return self.flops_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def mfu(self) -> float | None:
        return self.achieved_flops / self.peak_flops if self.peak_flops else None

    def message(self) -> str:
        """The job event's text."""
        span = f"{self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1 else str(self.steps[0])
        shares = ", ".join(f"{name.replace('_', ' ')} {self.shares[name]:.1%}" for name in CATEGORIES)
        rate = f"{self.achieved_flops / 1e12:.3g} TFLOP/s"
        if self.mfu is not None and self.peak_flops is not None:
            rate += f", MFU {self.mfu:.1%} of {self.peak_flops / 1e12:.0f}"
        return (
            f"profile of step {span} on {self.device}: {self.step_s:.3f} s a step; {shares}; {rate} "
            "(FLOPs = T·(4·N + 2·N_trainable) + 6·L·d·S·T)"
        )


@dataclass
class StepProfiler:
    """torch.profiler around steps ``first`` to ``last`` of a job (1-based), then a ``ProfileReport``.

    ``copy_wait``: the engine's total copy-wait seconds so far (None without the engine); ``flops``: a step's FLOPs
    from its tokens.
    """

    device: torch.device
    first: int
    last: int
    flops: Callable[[int], int]
    peak: float | None
    copy_wait: Callable[[], float] | None = None
    _profile: torch.profiler.profile | None = field(default=None, init=False)
    _started: float = field(default=0.0, init=False)
    _wait_before: float = field(default=0.0, init=False)
    _tokens: int = field(default=0, init=False)

    @classmethod
    def over_steps(cls, done: int, total: int, **kwargs: object) -> StepProfiler:
        """Two steps after the first two (compiling, the order recorded, ``gpu_memory_budget: auto`` measured), or
        the last ones of a shorter job; ``done``: steps trained before this attempt."""
        first = done + 3 if total - done >= 4 else max(done + 1, total - 1)
        return cls(first=first, last=min(first + 1, total), **kwargs)  # type: ignore[arg-type]

    def before_step(self, step: int) -> None:
        """Call before training step ``step`` (1-based)."""
        if step != self.first:
            return
        _synchronize(self.device)  # a CPU-GPU sync point: the profiled time starts with an idle device
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        self._wait_before = self.copy_wait() if self.copy_wait is not None else 0.0
        self._started = time.perf_counter()

    def after_step(self, step: int, tokens: int | None) -> ProfileReport | None:
        """Call after step ``step`` with its tokens; the report once the last profiled step is done."""
        if self._profile is None or step < self.first:
            return None
        self._tokens += tokens or 0
        if step < self.last:
            return None
        _synchronize(self.device)
        seconds = time.perf_counter() - self._started
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        _write_tables(profile, self.device, f"steps{self.first}-{self.last}")
        # The engine counts a step's copy wait when the next step ends: the window's count is one step late.
        waited = (self.copy_wait() if self.copy_wait is not None else 0.0) - self._wait_before
        steps = list(range(self.first, self.last + 1))
        return report_from(
            profile, self.device, steps, seconds, waited, self.flops(self._tokens) // len(steps), self.peak
        )


def report_from(
    profile: torch.profiler.profile,
    device: torch.device,
    steps: list[int],
    seconds: float,
    copy_wait_s: float,
    flops_per_step: int,
    peak: float | None,
) -> ProfileReport:
    """The report of a finished profile over ``steps`` that took ``seconds`` in all."""
    totals = seconds_by_class(_timed_events(profile, device))
    totals["copy_wait"] += max(copy_wait_s, 0.0)
    wall = max(seconds, 1e-9)
    shares = {name: totals[name] / wall for name in CATEGORIES if name != "other"}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return ProfileReport(steps, seconds / len(steps), shares, flops_per_step, peak, name)


def _timed_events(profile: torch.profiler.profile, device: torch.device) -> Iterable[tuple[str, float]]:
    """(name, seconds) of every kernel on a GPU, or of every operator's own time on the CPU."""
    want = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    for row in profile.key_averages():
        if row.device_type != want:
            continue
        micros = row.self_device_time_total if device.type == "cuda" else row.self_cpu_time_total
        yield row.key, micros / 1e6


def _write_tables(profile: torch.profiler.profile, device: torch.device, name: str) -> None:
    """With ``FERRY_PROFILE_DIR`` set (a bench's or a developer's switch, not a spec field): the profiler's own
    tables of the window, by device time and by host time, and the number of kernels launched, so a share of
    ``other`` can be traced to the operators and to the host's launch rate."""
    folder = os.environ.get("FERRY_PROFILE_DIR")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    averages = profile.key_averages()
    kernels = sum(row.count for row in averages if row.device_type == torch.autograd.DeviceType.CUDA)
    by_device = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    text = (
        f"kernels launched: {kernels}\n\n"
        + averages.table(sort_by=by_device, row_limit=40)
        + "\n\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=25)
    )
    path = os.path.join(folder, f"profile-{os.getpid()}-{name}.txt")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
