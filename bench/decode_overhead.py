"""Host time per decode step of GRPO's generation, on the CPU: a deep Llama made so narrow that compute is
negligible, decoded by Ferry's loop (jobs/objectives/generation.py) on the plain model and through the offload
engine with every unit kept on the device, beside transformers' own ``model.generate``; and with the decode step
compiled over a static KV cache (``training.compile``, jobs/objectives/compiled_decode.py; on the CPU without
CUDA graphs, so what it shows is the compiled graph's host time, not a graph replay's).

    python bench/decode_overhead.py                       # 32 layers, 32 wide, LoRA r16, 16 rows, 64 new tokens
    python bench/decode_overhead.py --profile             # and cProfile's top entries of the engine row
    python bench/decode_overhead.py --compile-backend none  # without the compiled rows (training.compile's)

Same layer count and batch as the 8B GRPO bench (bench/grpo_bench.py), one CPU thread. What a row costs here
is Python and dispatch per decode step, which a GPU step pays as well, before its kernels: on a launch-bound
decode that is the step.

Measured 2026-12-07 (this CPU, torch 2.13, defaults, inductor): transformers generate 53.2 ms, Ferry's eager loop
61.1 ms (engine, every unit kept: 70.5 ms), the compiled decode step 24.8 ms (engine: 32.7 ms) per decode step,
prefill included; the compiled rows compile in their warm-up (a few minutes in all on one CPU thread).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs.objectives import compiled_decode
from jobs.objectives.generation import generate
from offload import OffloadOptions, OffloadTrainingManager


def narrow_llama(layers: int, lora_rank: int) -> nn.Module:
    """Llama's modules, 32 wide, with peft's LoRA on every linear of every layer (``lora_rank`` 0: none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    model: nn.Module = LlamaForCausalLM(config)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=targets))
    return model.eval()


def syncs_per_step(run: Callable[[], int]) -> float:
    """Device-to-host reads (``bool``, ``item``, ``tolist``, ``int`` of a tensor) per decode step of one loop: on
    a GPU each waits for every kernel queued before it, so the host stops queueing the next step's."""
    names = ("__bool__", "item", "tolist", "__int__")
    originals = {name: getattr(torch.Tensor, name) for name in names}
    count = 0

    def counting(original: Callable[..., object]) -> Callable[..., object]:
        def read(self: torch.Tensor, *args: object) -> object:
            nonlocal count
            count += 1
            return original(self, *args)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        forwards = run()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return count / forwards


def ms_per_step(run: Callable[[], int], repeats: int) -> float:
    """Median over ``repeats`` of a whole decode loop's seconds over its forwards, in ms."""
    run()  # warm-up (and, with the engine, nothing left to record)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        forwards = run()
        times.append((time.perf_counter() - started) / forwards)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=16, help="0: no adapters")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile-backend", choices=["inductor", "aot_eager", "none"], default="inductor",
                        help="the compiled rows' torch.compile backend (none: no compiled rows)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = [[1 + (i * 7 + j) % 250 for j in range(12 + i % 4)] for i in range(args.rows)]
    new = args.new_tokens
    cpu = torch.device("cpu")

    def ferry(model: nn.Module, compiled: bool = False) -> Callable[[], int]:
        def run() -> int:
            generator = torch.Generator().manual_seed(0)
            stops = frozenset({299})  # a stop token, as GRPO's eos: the loop looks at whether every row stopped
            out = generate(model, prompts, max_new_tokens=new, temperature=1.0, stops=stops, device=cpu,
                           generator=generator, compile_decode=compiled)  # fmt: skip
            return out.forwards

        return run

    plain = narrow_llama(args.layers, args.lora_rank)
    hf_ids = torch.tensor([[0] * (16 - len(p)) + p for p in prompts])
    hf_mask = (torch.arange(16) >= torch.tensor([16 - len(p) for p in prompts]).unsqueeze(1)).long()

    def hf_generate() -> int:
        torch.manual_seed(0)
        with torch.no_grad():
            plain.generate(input_ids=hf_ids, attention_mask=hf_mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, top_k=0, pad_token_id=0, eos_token_id=299)  # fmt: skip
        return new

    kept = narrow_llama(args.layers, args.lora_rank)
    manager = OffloadTrainingManager(
        kept, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=1 << 40)
    )
    with torch.no_grad():
        kept(input_ids=torch.tensor([prompts[0]]))
    manager.after_forward()  # fixes the order and keeps every unit
    assert not any(unit.streams for unit in manager.units)
    runs = [
        ("transformers generate, plain model", hf_generate),
        ("Ferry decode loop, plain model", ferry(plain)),
        ("Ferry decode loop, engine, every unit kept", ferry(kept)),
    ]
    if args.compile_backend != "none":  # the warm-up run of ms_per_step compiles
        compiled_decode.BACKEND = args.compile_backend
        runs += [
            (f"Ferry compiled decode step ({args.compile_backend}), plain model", ferry(plain, compiled=True)),
            (f"Ferry compiled decode step ({args.compile_backend}), engine, every unit kept", ferry(kept, True)),
        ]
    rows = [(name, ms_per_step(run, args.repeats), syncs_per_step(run)) for name, run in runs]
    lora = f"LoRA r{args.lora_rank} on every linear" if args.lora_rank else "no LoRA"
    print(f"{args.layers} layers, 32 wide, {lora}, {args.rows} rows, {new} new tokens, CPU, 1 thread, "
          f"torch {torch.__version__}\n")  # fmt: skip
    print("| path | host ms per decode step | host syncs per decode step |\n|---|---|---|")
    for name, ms, syncs in rows:
        print(f"| {name} | {ms:.2f} | {syncs:.2f} |")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(ferry(kept))
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
