"""Dequantize on arrival: a streamed NF4 weight computes as the plain tensor the engine dequantized it into,
once per unit visit, with torchao's values bit for bit; a unit the budget keeps is dequantized once for the
run; an unstreamed model keeps torchao's in-layer path; the memory plan holds room for the dequantized form.
(Offloaded == resident training for every engine mode, with and without checkpointing: test_quantized.py,
which runs this path by default.)"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao")

from offload import OffloadOptions, OffloadTrainingManager
from offload.quant.dequantize_on_arrival import DequantizedParamOffloader, dequantized_bytes
from offload.quant.nf4_dequantize import dequantize_nf4_into
from offload.quant.nf4_linear import NF4Linear, is_nf4
from offload.quant.quantized import QuantizedPayload, is_quantized, quantize_frozen_weights, stored_bytes
from tests.offload.quant.test_quantized import WIDTH, make


@pytest.mark.parametrize("bias", [False, True])
def test_plain_linear_autograd_on_the_dequantized_weight_equals_torchaos_nf4_linear(bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, 2 * WIDTH, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    quantize_frozen_weights(layer, "nf4")
    assert type(layer) is (NF4Linear if bias else nn.Linear)
    x = torch.randn(4, 8, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4, 8, 2 * WIDTH, dtype=torch.bfloat16)
    expected = layer(x)  # torchao's LinearNF4 (the weight is the NF4 tensor)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)

    payload = QuantizedPayload(layer.weight, torch.empty(stored_bytes(layer.weight), dtype=torch.uint8))
    plain = torch.empty(layer.weight.shape, dtype=torch.bfloat16)
    blocks = (layer.weight.block_size, layer.weight.scaler_block_size)
    dequantize_nf4_into(plain, payload.views(payload.buffer), layer.weight.shape, torch.bfloat16, blocks)
    assert torch.equal(plain, layer.weight.to(torch.bfloat16))  # torchao's dequantization, bit for bit
    nf4 = layer.weight
    layer.weight = nn.Parameter(plain, requires_grad=False)  # what the engine swaps in during compute
    out = layer(x)
    (out_grad,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(out, expected) and torch.equal(out_grad, expected_grad)
    layer.weight = nf4


def _weights_seen_in_compute(model: nn.Module) -> list[tuple[int, type, torch.Tensor]]:
    """(id, type, a copy of) each NF4 layer's weight as its forward sees it (the parameter object stays one)."""
    seen: list[tuple[int, type, torch.Tensor]] = []

    def look(module: nn.Module, args: object) -> None:  # after the engine's own pre-hook: the unit is on
        seen.append((id(module.weight), type(module.weight), module.weight.detach().clone()))

    for block in model.blocks:
        for layer in (block.up, block.down):
            layer.register_forward_pre_hook(look)
    return seen


@pytest.mark.parametrize("granularity", ["leaf", "block"])
@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_a_streamed_nf4_weight_computes_as_a_plain_dequantized_tensor(
    checkpointing: str | None, granularity: str
) -> None:
    model = make("nf4", checkpointing)
    dequantized = {id(p): p.to(torch.bfloat16) for p in model.parameters() if is_nf4(p)}
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity=granularity))
    seen = _weights_seen_in_compute(model)
    for _ in range(2):
        seen.clear()
        model(torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)).float().sum().backward()
        manager.after_backward()
        assert len(seen) == 6 * (2 if checkpointing else 1)  # forward (and the recomputes)
        for key, kind, weight in seen:
            assert kind is nn.Parameter and not is_quantized(weight)
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, dequantized[key])
    assert all(is_nf4(p) and p.device.type == "cpu" for p in model.parameters() if id(p) in dequantized)
    manager.remove()


def test_turned_off_a_weight_stays_torchaos() -> None:
    model = make("nf4", "non_reentrant")
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(dequantize_on_arrival=False))
    seen = _weights_seen_in_compute(model)
    for _ in range(2):
        seen.clear()
        model(torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)).float().sum().backward()
        manager.after_backward()
    assert seen and all(is_nf4(w) for _, _, w in seen)  # torchao dequantizes inside the layer
    manager.remove()


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_a_weight_the_budget_keeps_is_dequantized_once_and_computes_as_a_plain_tensor(
    checkpointing: str | None,
) -> None:
    """Kept on the device for good, an NF4 weight is dequantized once, into memory of its own, and the layer
    computes with that plain tensor from then on: no dequantization in later steps, none inside the layer
    (torchao's path would dequantize in every call), and the budget is charged its dequantized bytes."""
    model = make("nf4", checkpointing)
    dequantized = {id(p): p.to(torch.bfloat16) for p in model.parameters() if is_nf4(p)}
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(gpu_memory_budget=1 << 30))
    offloaders = [o for o in manager._offloaders.values() if isinstance(o, DequantizedParamOffloader)]
    seen = _weights_seen_in_compute(model)
    done = []
    for _ in range(4):  # the budget keeps units resident from the end of the first step
        seen.clear()
        model(torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)).float().sum().backward()
        manager.after_backward()
        done.append(sum(o.dequantizations for o in offloaders))
        assert len(seen) == 6 * (2 if checkpointing else 1)
        for key, kind, weight in seen:
            assert kind is nn.Parameter and not is_quantized(weight)
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, dequantized[key])
    # Kept when the budget is applied, at the end of the first step: no dequantization in any step after it.
    assert done[3] == done[2] == done[1] == done[0]
    assert all(o.resident and not is_quantized(o.tensor) for o in offloaders)  # only the plain form is there
    kept = manager._schedule.kept_bytes
    assert kept >= sum(dequantized_bytes(o.tensor) for o in offloaders) > 3 * sum(o.nbytes for o in offloaders)
    manager.remove()
    assert all(is_nf4(p) and p.device.type == "cpu" for p in model.parameters() if id(p) in dequantized)


def _dequantizations(monkeypatch: pytest.MonkeyPatch, checkpointing: str | None, arrival: bool) -> list[tuple]:
    """Per step: (dequantizations on arrival, NF4 payload copies, torchao dequantizations inside layers)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    from offload.transfers import CopyEngine

    model = make("nf4", checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(dequantize_on_arrival=arrival))
    offloaders = [o for o in manager._offloaders.values() if is_quantized(o.tensor)]
    payloads = {o.host.data_ptr() for o in offloaders}
    in_layer: list[int] = []
    original = NF4Tensor.get_original_weight
    monkeypatch.setattr(  # NF4Parts runs this same code over plain tensors: not counted here
        NF4Tensor, "get_original_weight", lambda self: in_layer.append(isinstance(self, NF4Tensor)) or original(self)
    )
    copied: list[int] = []
    to_device = CopyEngine.to_device
    monkeypatch.setattr(
        CopyEngine, "to_device", lambda self, host, **k: copied.append(host.data_ptr()) or to_device(self, host, **k)
    )
    counts = []
    for _ in range(3):
        before = sum(getattr(o, "dequantizations", 0) for o in offloaders)
        copied.clear()
        in_layer.clear()
        model(torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)).float().sum().backward()
        manager.after_backward()
        done = sum(getattr(o, "dequantizations", 0) for o in offloaders) - before
        counts.append((done, sum(1 for address in copied if address in payloads), sum(in_layer)))
    manager.remove()
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_dequantization_runs_once_per_unit_visit(monkeypatch: pytest.MonkeyPatch, checkpointing: str | None) -> None:
    arrival = _dequantizations(monkeypatch, checkpointing, arrival=True)
    torchao = _dequantizations(monkeypatch, checkpointing, arrival=False)
    for (done, copies, in_layer), (_, torchao_copies, torchao_in_layer) in zip(arrival, torchao, strict=True):
        # One dequantization per payload copy, none inside the layers: forward's, and backward's (a
        # checkpoint's recompute and the backward share the copy). torchao's path dequantizes in every call:
        # with checkpointing 3 per weight and step (forward, recompute, backward), over as many copies or
        # more (a unit whose payloads and rooms are still in its ring slot is neither copied nor dequantized
        # again: test_ring_reuse.py; torchao's path keeps nothing dequantized, so it copies every visit).
        assert done == copies <= torchao_copies and in_layer == 0
        assert 0 < copies <= 2 * 6
        assert torchao_in_layer > done if checkpointing else torchao_in_layer >= done


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_block_units_nf4_weights_are_dequantized_in_one_call_per_visit(
    monkeypatch: pytest.MonkeyPatch, checkpointing: str | None, prefetch: int
) -> None:
    """Each dequantization call costs host time (dynamo's guards and wrappers on the GPU): a block unit's two
    NF4 weights arrive together and are dequantized by one call, not one call each."""
    from offload.quant import nf4_dequantize as kernels

    calls: list[int] = []  # weights dequantized by each call

    def counting(kernel: Callable[..., None], weights: Callable[[tuple], int]) -> Callable[[], Callable[..., None]]:
        def counted(*args: object) -> None:
            calls.append(weights(args))
            kernel(*args)

        return lambda: counted

    # The eager kernels (what the CPU runs): over lists of rooms, or over a slot's buffers with a layout.
    monkeypatch.setattr(
        kernels, "_eager", counting(kernels._eager(), lambda a: len(a[0]) if isinstance(a[0], list) else 1)
    )
    if hasattr(kernels, "_eager_spans"):
        monkeypatch.setattr(kernels, "_eager_spans", counting(kernels._eager_spans(), lambda a: len(a[2])))
    model = make("nf4", checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", prefetch=prefetch))
    payloads = [o.host for o in manager._offloaders.values() if is_quantized(o.tensor)]
    copied = _copied_ranges(monkeypatch)
    for _ in range(3):
        calls.clear()
        copied.clear()
        model(torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)).float().sum().backward()
        manager.after_backward()
        copies = sum(_covered(payload, copied) for payload in payloads)
        assert copies >= 2  # each block's two weights, at least once (forward), unless still in the ring
        assert calls == [2] * (copies // 2)  # one call per block visit, covering both of its weights
    manager.remove()


def _copied_ranges(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The host byte ranges that ``CopyEngine.to_device`` copies from here on (cleared by the caller)."""
    from offload.transfers import CopyEngine

    copied: list[tuple[int, int]] = []
    to_device = CopyEngine.to_device

    def counted(self: CopyEngine, host: torch.Tensor, **kwargs: object) -> object:
        copied.append((host.data_ptr(), host.data_ptr() + host.numel() * host.element_size()))
        return to_device(self, host, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CopyEngine, "to_device", counted)
    return copied


def _covered(payload: torch.Tensor, copied: list[tuple[int, int]]) -> int:
    """How many of the ``copied`` ranges hold all of ``payload``'s bytes."""
    start, end = payload.data_ptr(), payload.data_ptr() + payload.numel()
    return sum(1 for low, high in copied if low <= start and end <= high)


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_a_block_units_nf4_payloads_arrive_in_one_copy(
    monkeypatch: pytest.MonkeyPatch, checkpointing: str | None
) -> None:
    """Every copy launch costs host time (the launch, its timing and completion events, the engine's Python),
    and a block's NF4 payloads lie in the pinned arena as in its ring slot: a block's arrival is one copy of
    all its payloads, not one copy per weight. The values are checked by the tests above."""
    model = make("nf4", checkpointing)
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block"))
    batches = {id(o.batch): o.batch for o in manager._offloaders.values() if getattr(o, "batch", None) is not None}
    contiguous = [b for b in batches.values() if len(b.runs) == 1]
    assert len(contiguous) >= 2, "the arena split most blocks' payloads: the test would not test the one copy"
    copied = _copied_ranges(monkeypatch)
    for _ in range(2):
        copied.clear()
        model(torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)).float().sum().backward()
        manager.after_backward()
        for batch in contiguous:
            first, last = batch.members[0].host, batch.members[-1].host
            arrivals = [r for r in copied if r[0] <= first.data_ptr() and last.data_ptr() < r[1]]
            per_weight = [r for r in copied if r[0] == last.data_ptr()]
            assert arrivals and not per_weight  # the block's payloads came in copies that hold them all
    manager.remove()


def test_the_plan_holds_room_for_the_dequantized_form_and_the_limit_counts_it() -> None:
    model = make("nf4")
    weights = [p for p in model.parameters() if is_nf4(p)]
    off = OffloadTrainingManager(model, "cpu", options=OffloadOptions(dequantize_on_arrival=False))
    off_ring, off_link = off.plan.ring_bytes, off.plan.streamed_bytes
    off.remove()
    on = OffloadTrainingManager(model, "cpu")
    depth = 2  # prefetch 1: the unit computing and the one copied ahead, per ring class
    room = sum(dequantized_bytes(w) for w in weights[:2])  # one block's up and down: a class each
    assert on.plan.room_bytes >= depth * room and on.plan.ring_bytes == off_ring + on.plan.room_bytes
    assert on.plan.streamed_bytes == off_link  # the link still carries the quantized payload only
    x = torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    on.after_backward()
    assert on.stats().ring_overflows == 0
    assert on.stats().peak_device_bytes >= stored_bytes(weights[0]) + dequantized_bytes(weights[0])  # rooms count
    on.remove()
    with pytest.raises(ValueError, match="gpu_memory_limit"):
        OffloadTrainingManager(
            model, "cpu", options=OffloadOptions(gpu_memory_limit=(off_ring + on.plan.ring_bytes) // 2)
        )


def test_an_adapter_still_sees_a_quantized_base_between_steps() -> None:
    model = make("nf4", "non_reentrant")
    manager = OffloadTrainingManager(model, "cpu")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)
    F.mse_loss(model(x).float(), x.float()).backward()
    manager.after_backward()
    optimizer.step()
    state = model.state_dict()  # a checkpoint between steps: the NF4 base, as saved without the engine
    assert all(is_nf4(state[f"blocks.{i}.{n}.weight"]) for i in range(3) for n in ("up", "down"))
    manager.remove()


def _block_in_a_slot(device: str) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, tuple, tuple]:
    """Four NF4 weights of a block's shapes packed in one slot buffer as the ring lays them out: the NF4
    tensors, the slot, its room, the flat room views and the span layout."""
    from torchao.quantization import to_nf4

    from offload.quant.nf4_dequantize import pack_nf4_into
    from offload.quant.quantized import aligned

    torch.manual_seed(0)
    shapes = [(WIDTH, WIDTH), (WIDTH, WIDTH), (4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH)]
    nf4s = [to_nf4(torch.randn(s, device=device, dtype=torch.bfloat16), 64, 256) for s in shapes]
    slot = torch.zeros(sum(aligned(stored_bytes(t)) for t in nf4s), dtype=torch.uint8, device=device)
    room = torch.zeros(sum(t.numel() for t in nf4s), dtype=torch.bfloat16, device=device)
    layout = pack_nf4_into(slot, nf4s)
    starts = [0, *itertools.accumulate(t.numel() for t in nf4s)]  # each weight's room, one after another
    rooms = tuple(room[a:b] for a, b in itertools.pairwise(starts))
    return nf4s, slot, room, rooms, layout


def test_a_slots_weights_dequantize_into_their_rooms_with_torchaos_values() -> None:
    from offload.quant.nf4_dequantize import dequantize_nf4_spans_into

    nf4s, slot, room, rooms, layout = _block_in_a_slot("cpu")
    dequantize_nf4_spans_into(rooms, slot, layout)
    assert torch.equal(room, torch.cat([t.get_original_weight().reshape(-1) for t in nf4s]))


def test_the_compiled_dequantization_is_one_pointwise_pass_per_weight() -> None:
    """What inductor is given: no ``stack`` (a temporary it fills and then copies: two passes over each weight)
    and no ``slice_scatter`` chain over the slot's room (one kernel in which every element evaluates every
    weight's branch). Both slowed a block's dequantization 4.5x on the H200 (bench/RESULTS.md, issue 18)."""
    from torch._functorch.aot_autograd import aot_function

    from offload.quant import nf4_dequantize as kernels

    nf4s, slot, room, rooms, layout = _block_in_a_slot("cpu")
    dtypes, weights = layout
    typed = tuple(slot.view(dtype) for dtype in dtypes)
    graphs: list[torch.fx.GraphModule] = []

    def keep(graph: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append(graph)
        return graph

    # AOTAutograd's functionalized graph, as inductor receives it (the rooms are inputs it mutates).
    traced = aot_function(lambda r, p: kernels._eager_spans()(r, p, weights), fw_compiler=keep)
    with torch.no_grad():
        traced(rooms, typed)
    assert torch.equal(room, torch.cat([t.get_original_weight().reshape(-1) for t in nf4s]))
    ops = {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert not {op for op in ops if "scatter" in op or "cat" in op or "stack" in op}, ops


@pytest.mark.gpu
def test_a_blocks_compiled_dequantization_is_one_kernel_per_weight_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from offload.quant import nf4_dequantize as kernels
    from offload.quant.nf4_dequantize import dequantize_nf4_spans_into

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(kernels, "GRAPHS_ON_CUDA", False)  # the compiled call's own kernels
    nf4s, slot, room, rooms, layout = _block_in_a_slot("cuda")
    dequantize_nf4_spans_into(rooms, slot, layout)  # compiles
    room.zero_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        dequantize_nf4_spans_into(rooms, slot, layout)
        torch.cuda.synchronize()
    launched = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not kernels._COMPILE_FAILED
    assert len(launched) == len(nf4s), [e.name for e in launched]
    assert torch.equal(room, torch.cat([t.get_original_weight().reshape(-1) for t in nf4s]))


@pytest.mark.gpu
def test_a_slots_dequantization_is_replayed_as_a_cuda_graph_over_the_live_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled call costs ~286 us of host time per block visit on the H200; a slot seen before replays it as a CUDA
    graph instead (its first call is the compiled call, and the default stream never captures). The replay
    reads the payloads there now (a later unit's weights in the same slot) and writes torchao's values;
    another slot gets a graph of its own."""
    from torchao.quantization import to_nf4

    from offload.quant import nf4_dequantize as kernels
    from offload.quant.nf4_dequantize import SlotGraphs, dequantize_nf4_spans_into, pack_nf4_into

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphs = SlotGraphs()
    monkeypatch.setattr(kernels, "_SLOT_GRAPHS", graphs)
    nf4s, slot, room, rooms, layout = _block_in_a_slot("cuda")

    def expected(weights: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.get_original_weight().reshape(-1) for t in weights])

    for _ in range(3):  # on the default stream (the compute stream's, no prefetch): the compiled call, no capture
        dequantize_nf4_spans_into(rooms, slot, layout)
    assert (graphs.captures, graphs.replays) == (0, 0) and not graphs.failed
    torch.randn(1, device="cuda")  # the CUDA RNG was left alone (a refused capture can leave it broken)
    stream = torch.cuda.Stream()  # the engine dequantizes on its copy stream
    room.zero_()
    stream.wait_stream(torch.cuda.current_stream())  # after the writes made on the default stream
    with torch.cuda.stream(stream):
        dequantize_nf4_spans_into(rooms, slot, layout)  # compiled before: captured, then replayed
    torch.cuda.synchronize()
    assert (graphs.captures, graphs.replays) == (1, 1) and not graphs.failed
    assert torch.equal(room, expected(nf4s))

    others = [to_nf4(torch.randn(t.shape, device="cuda", dtype=torch.bfloat16), 64, 256) for t in nf4s]
    assert pack_nf4_into(slot, others) == layout  # the next unit in the same slot: same layout, new bytes
    stream.wait_stream(torch.cuda.current_stream())  # after the writes made on the default stream
    with torch.cuda.stream(stream):
        dequantize_nf4_spans_into(rooms, slot, layout)
    torch.cuda.synchronize()
    assert (graphs.captures, graphs.replays) == (1, 2)
    assert torch.equal(room, expected(others))

    slot2, room2 = slot.clone(), torch.zeros_like(room)
    rooms2 = tuple(room2[r.storage_offset() : r.storage_offset() + r.numel()] for r in rooms)
    stream.wait_stream(torch.cuda.current_stream())  # after the writes made on the default stream
    with torch.cuda.stream(stream):
        dequantize_nf4_spans_into(rooms2, slot2, layout)  # its first call: the compiled call
        assert (graphs.captures, graphs.replays) == (1, 2)
        room2.zero_()
        dequantize_nf4_spans_into(rooms2, slot2, layout)
    torch.cuda.synchronize()
    assert (graphs.captures, graphs.replays) == (2, 3)
    assert torch.equal(room2, expected(others)) and torch.equal(room, expected(others))
