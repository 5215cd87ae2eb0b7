"""``training.compile`` for GRPO's decode loop: the one-token forward compiled over a static KV cache.

The oracle is the eager loop (jobs/objectives/generation.py) on a save_pretrained Llama with peft's LoRA: the
compiled steps give its tokens, greedy and seeded sampling alike (exactly, on the CPU: the same ops in the same
order, ``aot_eager``), see LoRA weights changed in place between generations, and compile once per shape.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs.objectives import compiled_decode
from jobs.objectives.generation import generate

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5], [9, 3], [5, 5, 5, 1], [8]]  # different lengths: the short ones left-padded
STOPS = frozenset({3})


def lora_llama(directory: Path) -> nn.Module:
    """A tiny Llama written by ``save_pretrained`` and read back, with random (non-zero) LoRA on q and v."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    base = LlamaForCausalLM.from_pretrained(directory)
    config_lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, config_lora)


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_decode, "BACKEND", "aot_eager")  # the same graphs, no code generation
    torch._dynamo.reset()


def decoded(model: nn.Module, *, compiled: bool, temperature: float, seed: int = 1, device: torch.device = CPU) -> Any:
    return generate(model, PROMPTS, max_new_tokens=10, temperature=temperature, top_p=0.9, stops=STOPS,
                    device=device, generator=torch.Generator(device).manual_seed(seed),
                    compile_decode=compiled)  # fmt: skip


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_decode_gives_the_eager_loops_tokens(tmp_path: Path, temperature: float) -> None:
    model = lora_llama(tmp_path)
    eager = decoded(model, compiled=False, temperature=temperature)
    before = graphs()
    ours = decoded(model, compiled=True, temperature=temperature)
    assert graphs() == before + 1  # the one-token forward, once
    assert torch.equal(ours.ids, eager.ids) and torch.equal(ours.mask, eager.mask)
    assert ours.forwards == eager.forwards
    assert compiled_decode._ATTRIBUTE in model.__dict__  # the compiled path ran, not the fallback


def test_a_second_generation_of_the_same_shape_does_not_recompile(tmp_path: Path) -> None:
    model = lora_llama(tmp_path)
    decoded(model, compiled=True, temperature=1.0)
    before = graphs()
    again = decoded(model, compiled=True, temperature=1.0, seed=7)
    assert graphs() == before
    assert torch.equal(again.ids, decoded(model, compiled=False, temperature=1.0, seed=7).ids)


def test_lora_weights_changed_in_place_between_generations_are_followed(tmp_path: Path) -> None:
    model = lora_llama(tmp_path)
    first = decoded(model, compiled=True, temperature=0.0)
    torch.manual_seed(3)
    with torch.no_grad():  # as the optimizer's step: the same tensors, new values
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 2)
    before = graphs()
    second = decoded(model, compiled=True, temperature=0.0)
    assert graphs() == before  # the weights are graph inputs: nothing to compile again
    assert not torch.equal(second.ids, first.ids)  # the new adapters do change the tokens...
    assert torch.equal(second.ids, decoded(model, compiled=False, temperature=0.0).ids)  # ...to the eager loop's


def test_a_class_without_static_cache_support_decodes_eagerly_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = lora_llama(tmp_path)
    model.get_base_model()._can_compile_fullgraph = False
    compiled_decode._fallbacks_logged.clear()
    with caplog.at_level(logging.INFO, logger="jobs.objectives.compiled_decode"):
        ours = decoded(model, compiled=True, temperature=1.0)
    assert torch.equal(ours.ids, decoded(model, compiled=False, temperature=1.0).ids)
    assert "does not support a static KV cache" in caplog.text and compiled_decode._ATTRIBUTE not in model.__dict__


def test_a_compile_that_raises_falls_back_to_the_eager_loop_from_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = lora_llama(tmp_path)

    def broken(self: Any, model: nn.Module, *args: Any) -> torch.Tensor:
        raise RuntimeError("inductor could not lower this")

    monkeypatch.setattr(compiled_decode.DecodeStep, "__call__", broken)
    compiled_decode._fallbacks_logged.clear()
    with caplog.at_level(logging.INFO, logger="jobs.objectives.compiled_decode"):
        ours = decoded(model, compiled=True, temperature=1.0)  # the generator rewound: the eager loop's draws
    assert torch.equal(ours.ids, decoded(model, compiled=False, temperature=1.0).ids)
    assert "inductor could not lower this" in caplog.text
    calls: list[int] = []
    monkeypatch.setattr(compiled_decode, "_decode", lambda *args: calls.append(1))
    decoded(model, compiled=True, temperature=1.0)
    assert not calls  # a later generation goes eager at once, without trying to compile again


def test_compiled_decode_over_the_engine_keeping_every_unit(tmp_path: Path) -> None:
    from offload import OffloadOptions, OffloadTrainingManager

    model, plain = lora_llama(tmp_path / "a"), lora_llama(tmp_path / "b")
    manager = OffloadTrainingManager(
        model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=1 << 40)
    )
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPTS[0]]))
    manager.after_forward()  # fixes the order and keeps every unit
    assert not any(unit.streams for unit in manager.units)
    before = graphs()
    ours = decoded(model, compiled=True, temperature=1.0)
    assert graphs() == before + 1  # one graph: the engine's hooks of kept units do not break it
    assert compiled_decode._ATTRIBUTE in model.__dict__
    assert torch.equal(ours.ids, decoded(plain, compiled=False, temperature=1.0).ids)


def test_compiled_decode_over_units_the_engine_holds_for_generation(tmp_path: Path) -> None:
    """Every unit streams in training and is held (copied into memory of its own) for each generation: the
    compiled step reads the held copies, the same graph for the next generation's new copies."""
    from offload import OffloadOptions, OffloadTrainingManager

    model, plain = lora_llama(tmp_path / "a"), lora_llama(tmp_path / "b")
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=0))
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPTS[0]]))
    manager.after_forward()
    assert all(unit.streams for unit in manager.units)
    before = graphs()
    for seed in (1, 2):
        with manager.hold_for_inference(0) as hold:
            assert hold.units == hold.streamed == len(manager.units)
            ours = decoded(model, compiled=True, temperature=1.0, seed=seed)
        assert torch.equal(ours.ids, decoded(plain, compiled=False, temperature=1.0, seed=seed).ids)
        assert graphs() == before + 1  # compiled in the first generation only
    assert compiled_decode._ATTRIBUTE in model.__dict__


def test_compiled_decode_over_training_compiles_blocks_compiles_once_per_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs.models import compiled_blocks

    monkeypatch.setattr(compiled_blocks, "BACKEND", "aot_eager")
    model = lora_llama(tmp_path)
    eager = decoded(model, compiled=False, temperature=1.0)
    compiled_blocks.compile_repeated_blocks(model)  # training.compile's blocks: the step inlines them
    assert torch.equal(decoded(model, compiled=True, temperature=1.0).ids, eager.ids)
    before = graphs()
    assert torch.equal(decoded(model, compiled=True, temperature=1.0).ids, eager.ids)
    assert graphs() == before


def test_lora_grpo_training_with_the_compiled_decode_samples_what_the_eager_loop_samples() -> None:
    """The optimizer updates the adapters in place between the steps' generations: each compiled generation
    follows them, step after step, to the eager run's rewards and KL."""
    from peft import LoraConfig, get_peft_model

    from tests.jobs.llm_helpers import tiny_llama
    from tests.jobs.objectives.test_grpo import grpo_section, train_rewards

    def run(compiled: bool) -> list[dict[str, float]]:
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"])
        model = get_peft_model(tiny_llama(16), lora)
        return train_rewards(model, grpo_section(beta=0.04), steps=6, lr=5e-2, compile_decode=compiled)

    eager = run(False)
    before = graphs()
    compiled = run(True)
    assert graphs() == before + 1  # one step graph for the six generations
    assert [m["reward_mean"] for m in compiled] == [m["reward_mean"] for m in eager]
    assert [m["kl"] for m in compiled] == pytest.approx([m["kl"] for m in eager], abs=1e-6)
    assert len({m["reward_mean"] for m in eager}) > 1  # the policy moved: later steps sample differently


def test_grpo_compiles_the_decode_only_when_no_unit_streams_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import contextmanager
    from types import SimpleNamespace

    from jobs.objectives import grpo as grpo_module
    from jobs.objectives.grpo import GRPOLoss

    seen: list[bool] = []

    def spy(model: nn.Module, prompts: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["compile_decode"])
        raise StopIteration  # the decode loop's argument is all this test reads

    monkeypatch.setattr(grpo_module, "generate", spy)
    settings = SimpleNamespace(num_generations=2, max_new_tokens=4, temperature=1.0, top_p=1.0)
    for held, streamed in ((3, 3), (2, 3)):

        @contextmanager
        def hold(_bytes: int, held: int = held, streamed: int = streamed) -> Any:
            yield SimpleNamespace(units=held, streamed=streamed, describe=lambda: "generation kept some")

        loss = GRPOLoss(settings, lambda c, r: [0.0] * len(c), str, hold_weights=hold, compile_decode=True)
        model = nn.Linear(2, 2)
        with pytest.raises(StopIteration):
            loss.rollout(model, [[1, 2]], [{}], stops=frozenset(), pad_id=0, device=CPU)
    assert seen == [True, False]


def test_the_decoders_cache_is_static_addresses_so_cudagraph_trees_accept_its_in_place_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's own check (cudagraph trees skip a graph that mutates an input neither a parameter nor a static
    address) over the step's graph, on the CPU: the cache's layers made where transformers leaves them unmarked (its
    marks skipped, as while dynamo traces), the decoder marks every one of their tensors before the compiled step."""
    import transformers.cache_utils
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext
    from torch._inductor.cudagraph_utils import check_for_mutation_ignore_cuda_graph_managed_tensor
    from torch.utils._ordered_set import OrderedSet

    monkeypatch.setattr(transformers.cache_utils, "is_torchdynamo_compiling", lambda: True)  # only gates its marks
    mutated_inputs: list[list[int]] = []
    skip_reasons: list[str | None] = []

    def cudagraph_check(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        metadata = TracingContext.get().fw_metadata  # what inductor's compile_fx reads its static inputs from
        mutated = OrderedSet(i for i, info in enumerate(metadata.input_info) if info.mutates_data)
        mutated_inputs.append(list(mutated))
        skip_reasons.append(
            check_for_mutation_ignore_cuda_graph_managed_tensor(
                graph, OrderedSet(), mutated, metadata.static_input_indices
            )
        )
        return graph

    backend = aot_autograd(fw_compiler=cudagraph_check, keep_inference_input_mutations=True)
    monkeypatch.setattr(compiled_decode, "BACKEND", backend)
    model = lora_llama(tmp_path)
    ours = decoded(model, compiled=True, temperature=1.0)
    assert len(mutated_inputs) == 1 and len(mutated_inputs[0]) >= 2 * 2  # keys and values of both layers, in place
    assert skip_reasons == [None]
    cache = model.__dict__[compiled_decode._ATTRIBUTE]._cache
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values, layer.cumulative_length):
            assert getattr(tensor, "_dynamo_static_input_type", None) is not None  # how mark_static_address marks
    assert torch.equal(ours.ids, decoded(model, compiled=False, temperature=1.0).ids)


@pytest.mark.gpu
@pytest.mark.xfail(
    reason="expected to pass since the decoder marks the cache's tensors static addresses (inductor's mutation check "
    "passes on the CPU), not yet run on a GPU; on an H100 at f02ebe7, before that, the tokens matched but inductor "
    "skipped the CUDA graph (mutated inputs: the static cache's update)",
    strict=False,
)
def test_on_cuda_the_compiled_decode_replays_a_cuda_graph_and_gives_the_eager_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    monkeypatch.setattr(compiled_decode, "BACKEND", "inductor")
    cuda = torch.device("cuda")
    model = lora_llama(tmp_path).to(cuda)
    counters["inductor"].clear()
    for temperature in (0.0, 1.0):  # greedy and seeded sampling (the generator on the device)
        eager = decoded(model, compiled=False, temperature=temperature, device=cuda)
        ours = decoded(model, compiled=True, temperature=temperature, device=cuda)
        assert torch.equal(ours.ids, eager.ids) and torch.equal(ours.mask, eager.mask)
    step = model.__dict__[compiled_decode._ATTRIBUTE]
    assert step.cuda_graphs and counters["inductor"]["cudagraph_skips"] == 0  # no reason to run it without
    manager = get_manager(cuda.index or 0, create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values())  # cudagraph trees recorded the step
