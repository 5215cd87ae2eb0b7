"""Frozen weights stored and streamed quantized (torchao NF4 / int8): quantized + offloaded training equals
quantized resident training bitwise on the CPU; the link carries the quantized bytes; peft adapters trained
on the quantized base load onto it again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

pytest.importorskip("torchao")

from offload import OffloadOptions, OffloadTrainingManager
from offload.quant.nf4_linear import CompiledNF4Linear, NF4Linear
from offload.quant.quantized import (
    QuantizedPayload,
    is_quantized,
    quantize_frozen_weights,
    stored_bytes,
    stored_bytes_after,
)

WIDTH = 128  # NF4 needs numel divisible by 64 x 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, dtype=torch.bfloat16)
        self.up = nn.Linear(WIDTH, 2 * WIDTH, dtype=torch.bfloat16)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False, dtype=torch.bfloat16)
        self.adapter_a = nn.Linear(WIDTH, 4, bias=False, dtype=torch.bfloat16)
        self.adapter_b = nn.Linear(4, WIDTH, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.gelu(self.up(h))) + self.adapter_b(self.adapter_a(h))


class QStack(nn.Module):
    def __init__(self, checkpointing: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "reentrant":
            x = x.detach().requires_grad_()
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = block(x)
        return x


def make(method: str, checkpointing: str | None = None, compile_dequantization: bool = False) -> QStack:
    torch.manual_seed(0)
    model = QStack(checkpointing)
    model.requires_grad_(False)
    for block in model.blocks:
        block.adapter_a.requires_grad_(True)
        block.adapter_b.requires_grad_(True)
    names = quantize_frozen_weights(model, method, compile_dequantization=compile_dequantization)
    assert len(names) == 6  # up and down of each block; adapters stay trainable, norms are not linears
    return model


def train(
    model: QStack, offload: dict | None, steps: int = 4, device: str = "cpu"
) -> tuple[list[float], dict[str, torch.Tensor]]:
    manager = OffloadTrainingManager(model, device, **offload) if offload is not None else None
    if manager is None:
        model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, WIDTH, generator=generator).to(device, torch.bfloat16)
        loss = F.mse_loss(model(x).float(), x.float() + 1)
        loss.backward()
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if manager is not None:
        manager.remove()
    return losses, {n: p.detach().to("cpu").clone() for n, p in model.named_parameters() if p.requires_grad}


OFFLOADS = [
    pytest.param({}, id="default"),
    pytest.param({"enable_optimizer_cpu_offload": True}, id="optimizer-offload"),
    pytest.param({"options": OffloadOptions(granularity="block", prefetch=2)}, id="block"),
    pytest.param({"options": OffloadOptions(prefetch=0)}, id="prefetch0"),
    # One block kept (dequantized: 128 KiB of NF4 weights' bf16 form), the rest streamed; then every block.
    pytest.param({"options": OffloadOptions(gpu_memory_budget=150_000)}, id="budget"),
    pytest.param({"options": OffloadOptions(gpu_memory_budget=1 << 30)}, id="budget-all"),
    # Units with trainable host masters held from forward to backward: their NF4 weights leave the ring too.
    pytest.param(
        {"enable_optimizer_cpu_offload": True, "options": OffloadOptions(gpu_memory_budget=150_000)},
        id="budget-optimizer-offload",
    ),
    pytest.param({"options": OffloadOptions(dequantize_on_arrival=False)}, id="torchao-in-layer"),
]


CASES = [
    *[pytest.param("nf4", c, o.values[0], id=f"nf4-{c}-{o.id}") for c in (None, "non_reentrant") for o in OFFLOADS],
    pytest.param("nf4", "reentrant", {}, id="nf4-reentrant"),
    pytest.param("int8", None, {}, id="int8"),
    pytest.param("int8", "non_reentrant", {"enable_optimizer_cpu_offload": True}, id="int8-checkpointed-opt-offload"),
]


@pytest.mark.parametrize(("method", "checkpointing", "offload"), CASES)
def test_quantized_offloaded_equals_quantized_resident(method: str, checkpointing: str | None, offload: dict) -> None:
    resident_losses, resident = train(make(method, checkpointing), None)
    losses, trained = train(make(method, checkpointing), offload)
    assert losses == resident_losses
    for name in resident:
        assert torch.equal(trained[name], resident[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize(("method", "compiled"), [("nf4", False), ("nf4", True), ("int8", False)])
def test_quantized_offloaded_matches_quantized_resident_on_gpu(
    method: str, compiled: bool, checkpointing: str | None
) -> None:
    from offload.quant import nf4_dequantize

    resident_losses, resident = train(make(method, checkpointing, compiled), None, device="cuda")
    replays = nf4_dequantize._SLOT_GRAPHS.replays
    in_layer = {"options": OffloadOptions(dequantize_on_arrival=False)}
    block = {"options": OffloadOptions(granularity="block", prefetch=2)}  # a block's weights in one call
    kept = {"options": OffloadOptions(granularity="block", gpu_memory_budget=150_000)}  # one block dequantized
    for offload in ({}, {"enable_optimizer_cpu_offload": True}, block, in_layer, kept):
        losses, trained = train(make(method, checkpointing, compiled), offload, device="cuda")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(resident_losses), rtol=1e-2, atol=1e-3)
        for name in resident:
            torch.testing.assert_close(trained[name], resident[name], rtol=2e-2, atol=2e-3, msg=name)
    assert not nf4_dequantize._COMPILE_FAILED  # the NF4 dequantization on arrival ran compiled
    assert not nf4_dequantize._SLOT_GRAPHS.failed
    assert (nf4_dequantize._SLOT_GRAPHS.replays > replays) == (method == "nf4")  # and replayed from CUDA graphs


@pytest.mark.gpu
def test_dequantization_on_arrival_compiled_equals_torchao_on_gpu() -> None:
    from torchao.quantization import to_nf4

    from offload.quant import nf4_dequantize
    from offload.quant.nf4_dequantize import _eager, dequantize_nf4_all_into

    torch.manual_seed(0)
    outs, inners, metas, expected = [], [], [], []
    for shape in ((1024, 512), (2048, 1024), (1024, 512)):
        nf4 = to_nf4(torch.randn(shape, device="cuda", dtype=torch.bfloat16), 64, 256)
        buffer = torch.empty(stored_bytes(nf4), dtype=torch.uint8, device="cuda")
        inners.append(QuantizedPayload(nf4, buffer).views(buffer))
        metas.append((nf4.shape, nf4.dtype, (nf4.block_size, nf4.scaler_block_size)))
        outs.append(torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
        expected.append(nf4.to(torch.bfloat16))
    dequantize_nf4_all_into(outs, inners, tuple(metas))  # one compiled call for all three, as a unit's visit
    for out, inner, meta, want in zip(outs, inners, metas, expected, strict=True):
        eager = torch.empty_like(out)
        _eager()([eager], [inner], (meta,))
        assert torch.equal(eager, want)  # torchao's own code over the plain inner tensors
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert not nf4_dequantize._COMPILE_FAILED


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_the_stored_bytes_are_known_from_the_shape_before_quantizing(method: str) -> None:
    model = make(method)
    with torch.device("meta"):
        shapes = QStack(None).requires_grad_(False)
    for (name, real), (_, meta) in zip(model.named_parameters(), shapes.named_parameters(), strict=True):
        if is_quantized(real):
            assert stored_bytes_after(meta, method) == stored_bytes(real), name


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_the_link_carries_the_quantized_bytes(method: str) -> None:
    model = make(method)
    quantized = [p for p in model.parameters() if is_quantized(p)]
    stored = sum(stored_bytes(p) for p in quantized)
    full = sum(p.numel() * 2 for p in quantized)  # as bf16
    assert stored < full / (3.5 if method == "nf4" else 1.9)
    manager = OffloadTrainingManager(model, "cpu")
    other = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad and not is_quantized(p))
    assert manager.plan.pinned_requested_bytes <= stored + other + 64 * 64
    reused = 0
    for _ in range(2):
        x = torch.randn(2, WIDTH, dtype=torch.bfloat16)
        model(x).float().sum().backward()
        manager.after_backward()
        # forward + backward: each quantized payload at most twice, plus the small frozen norms; copied, or
        # reused from a ring slot that still held it (test_ring_reuse.py)
        stats = manager.stats()
        needed = stats.last_step_h2d_bytes + stats.reused_bytes - reused
        assert stored <= needed <= 2 * (stored + other)
        reused = stats.reused_bytes
    assert all(is_quantized(p) and p.device.type == "cpu" for p in quantized)
    manager.remove()


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("arrival", [True, False], ids=["dequantized-on-arrival", "torchao-in-layer"])
def test_a_streamed_weight_is_not_rebuilt_after_its_first_step(
    monkeypatch: pytest.MonkeyPatch, checkpointing: str | None, prefetch: int, arrival: bool
) -> None:
    # Rebuilding the torchao tensor (or the inner views the dequantization reads) over each device copy was
    # the host's cost of streaming NF4 (about 9 ms per block and step on the H200): copies into the ring land
    # at the same addresses every step, so what is built over them is reused. Training still equals the
    # resident run (the cases above).
    model = make("nf4", checkpointing)
    options = OffloadOptions(prefetch=prefetch, dequantize_on_arrival=arrival)
    manager = OffloadTrainingManager(model, "cpu", options=options)
    builds: list[int] = []
    build = QuantizedPayload.views
    monkeypatch.setattr(QuantizedPayload, "views", lambda self, *a, **k: builds.append(1) or build(self, *a, **k))
    for step in range(3):
        before = len(builds)
        x = torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)
        model(x).float().sum().backward()
        manager.after_backward()
        assert manager.stats().ring_overflows == 0
        if step > 0:
            assert len(builds) == before, f"step {step} rebuilt {len(builds) - before} device tensors"
    # The first step built them; dequantized on arrival nothing is built over a copy (the kernel reads the
    # slot's bytes at their offsets).
    assert bool(builds) is not arrival
    manager.remove()
    assert all(p.device.type == "cpu" for p in model.parameters() if is_quantized(p))


def test_remove_leaves_the_quantized_model_as_it_was() -> None:
    model = make("nf4")
    before = {n: p.get_original_weight().clone() for n, p in model.named_parameters() if is_quantized(p)}
    manager = OffloadTrainingManager(model, "cpu")
    x = torch.randn(2, WIDTH, dtype=torch.bfloat16)
    expected = model(x)
    manager.remove()
    for name, param in model.named_parameters():
        if name in before:
            assert is_quantized(param) and not param.quantized_data.is_pinned()
            assert torch.equal(param.get_original_weight(), before[name])
    assert torch.equal(model(x), expected)


def test_peft_adapters_trained_on_the_quantized_base_load_onto_it(tmp_path) -> None:
    peft = pytest.importorskip("peft")

    def base() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(WIDTH, WIDTH, dtype=torch.bfloat16), nn.GELU(), nn.Linear(WIDTH, WIDTH, dtype=torch.bfloat16)
        )
        return model

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=True)
    model = peft.get_peft_model(base(), config)
    quantize_frozen_weights(model, "nf4")
    manager = OffloadTrainingManager(model, "cpu")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        x = torch.randn(4, WIDTH, dtype=torch.bfloat16)
        F.mse_loss(model(x).float(), x.float()).backward()
        manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
    manager.remove()
    x = torch.randn(4, WIDTH, dtype=torch.bfloat16)
    expected = model(x)
    model.save_pretrained(tmp_path)

    fresh = base()
    fresh.requires_grad_(False)
    quantize_frozen_weights(fresh, "nf4")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    assert all(is_quantized(loaded.base_model.model[i].base_layer.weight) for i in (0, 2))
    assert torch.equal(loaded(x), expected)


def test_nf4_linears_get_ferry_classes_only_where_needed_and_stay_torchao_on_the_cpu() -> None:
    model = make("nf4")
    # The default: a bias-free layer stays torchao's as it is; a biased one adds its bias after the matmul
    # as torchao does, also when the engine dequantized its weight on arrival (test_dequantize_on_arrival.py).
    assert type(model.blocks[0].down) is nn.Linear
    assert type(model.blocks[0].up) is NF4Linear
    compiled = make("nf4", compile_dequantization=True)
    assert type(compiled.blocks[0].up) is CompiledNF4Linear and type(compiled.blocks[0].down) is CompiledNF4Linear
    assert type(compiled.blocks[0].adapter_a) is nn.Linear  # trainable: not quantized, not converted
    x = torch.randn(3, WIDTH, dtype=torch.bfloat16)
    for layer in (model.blocks[0].up, compiled.blocks[0].up):
        # torchao's own path (its F.linear override) on the CPU, bit for bit.
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def _torchao_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)  # NF4Tensor's own override: torchao's LinearNF4


@pytest.mark.gpu
def test_nf4_linear_dequantizes_in_one_kernel_on_gpu() -> None:
    """torchao's eager dequantization is about ten kernels per call; compiled, it is one (plus the matmul),
    with torchao's values, and the bf16 weight is not kept for backward (only the NF4 one is saved).
    Offloaded against resident with the compiled layer: test_quantized_offloaded_matches_quantized_resident_on_gpu."""
    torch.manual_seed(0)
    layer = nn.Linear(1024, 2048, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    quantize_frozen_weights(layer, "nf4", compile_dequantization=True)
    layer.to("cuda")
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    reference = _torchao_linear(x, layer)
    (reference_grad,) = torch.autograd.grad(reference.sum(), x)
    out = layer(x)  # compiles
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(grad, reference_grad)

    def kernels(run) -> int:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    with torch.no_grad():
        assert kernels(lambda: layer(x)) <= 3  # dequantize + matmul (cuBLAS may split it)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            layer(x)
            torch.cuda.synchronize()
        generated = [
            e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "triton" in e.name
        ]
        assert len(generated) == 1, generated  # the dequantization: one pass, no temporary copied out
        assert kernels(lambda: _torchao_linear(x, layer)) > 6  # torchao eager: the comparison this beats
    before = torch.cuda.memory_allocated()
    out = layer(x)  # with autograd: saves the NF4 weight only
    held = torch.cuda.memory_allocated() - before
    assert held < 1024 * 2048 * 2 // 4, held  # far less than the bf16 weight (4 MiB): just the output
    del out


def test_the_compiled_layers_dequantization_is_one_pointwise_pass_with_torchaos_values() -> None:
    """``CompiledNF4Linear``'s dequantization as inductor receives it: torchao's values, and no ``stack``/``cat``
    (torchao's final interleave, which inductor fills into a temporary and copies out: two kernels a weight)."""
    from torch._functorch.aot_autograd import aot_function
    from torchao.quantization import to_nf4

    from offload.quant import nf4_linear

    torch.manual_seed(0)
    weight = to_nf4(torch.randn(256, 512, dtype=torch.bfloat16), 64, 256)
    compiled = nf4_linear._compiled_dequantize()  # what the layer calls on a GPU; here compiled for the CPU
    assert torch.equal(compiled(weight, torch.bfloat16), weight.to(torch.bfloat16))
    graphs: list[torch.fx.GraphModule] = []

    def keep(graph: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append(graph)
        return graph

    traced = aot_function(lambda w: compiled._torchdynamo_orig_callable(w, torch.bfloat16), fw_compiler=keep)
    with torch.no_grad():
        assert torch.equal(traced(weight), weight.to(torch.bfloat16))
    ops = {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert ops and not {op for op in ops if "cat" in op or "stack" in op}, ops
