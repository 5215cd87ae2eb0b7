"""Chat fine-tuning as a user runs it, through the service: a LoRA SFT job on a 7B-class Llama config
(random init, as no hub is reachable) with a byte-level BPE tokenizer trained here, model offload, an eval
split, samples, a checkpoint. Driven over HTTP only; prints a table and writes a JSON transcript and a
markdown section (``--out``). The figures land in docs/llm-chat.md.

    python bench/llm_chat_e2e.py --out chat                 # on the GPU box (the H200)
    python bench/llm_chat_e2e.py --cpu --out chat           # a tiny config on the CPU: the same path
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import local_server
import torch
import yaml
from provenance import commit

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-2-7B's shapes: 6.7B parameters.
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512)  # fmt: skip


def conversations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Arithmetic chats: a pattern a randomly initialized model can start to learn within a few steps."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        chats.append(
            {
                "messages": [
                    {"role": "system", "content": "You are a calculator. Answer in one sentence."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
        )
    return chats


def train_tokenizer(directory: Path, texts: list[str], vocab_size: int) -> int:
    """A byte-level BPE trained on ``texts`` (seconds), saved as a transformers tokenizer with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    return len(tokenizer)


def write_random_llama(directory: Path, shapes: dict[str, int], device: str) -> int:
    """A Llama config with random N(0, 0.02) weights (unit norms), written with save_pretrained in bf16.

    Built on the meta device and filled on ``device`` (the GPU fills 6.7B values in milliseconds), then
    saved: the job loads it like any downloaded checkpoint.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shapes, dtype="bfloat16", tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(directory)
    count = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return count


def job_spec(cpu: bool) -> dict[str, Any]:
    return {
        "name": "chat-7b-lora" if not cpu else "chat-tiny-lora",
        "device": "cpu" if cpu else "cuda",
        "model": {"kind": "hf_causal_lm", "path": "llama", "dtype": "bfloat16"},
        "data": {
            "kind": "text",
            "path": "chats.jsonl",
            "format": "chat",
            "seq_len": 256,
            "tokenizer": {"kind": "hf", "path": "tokenizer"},
        },
        "lora": {
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "rank": 16,
            "alpha": 32,
        },
        "training": {
            "steps": 16,
            "batch_size": 4,
            "learning_rate": 2.0e-3,
            "scheduler": {"kind": "constant", "warmup_steps": 2},
            "mixed_precision": "bf16",
            "gradient_checkpointing": True,
        },
        "offload": {"enable_model_cpu_offload": True, "granularity": "block", "prefetch": 2},
        "eval": {"split": 0.1, "every_steps": 4, "max_batches": 2},
        "text_samples": {"prompts": ["What is 12 plus 7?"], "every_steps": 8, "max_new_tokens": 10},
        "checkpoint": {"every_steps": 8, "keep_last": 1},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.out)
    models, data = root / "models", root / "datasets"
    for directory in (models, data):
        directory.mkdir(parents=True, exist_ok=True)
    clock: dict[str, float] = {}
    started = time.perf_counter()
    chats = conversations(400)
    (data / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    texts = [m["content"] for c in chats for m in c["messages"]]
    vocab = train_tokenizer(models / "tokenizer", texts, 2048 if args.cpu else 8192)
    clock["tokenizer_s"] = time.perf_counter() - started
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    parameters = write_random_llama(models / "llama", TINY if args.cpu else LLAMA_7B, device)
    clock["random_weights_written_s"] = time.perf_counter() - started
    settings = {
        "FERRY_DATA_DIR": str(root / "ferry"),
        "FERRY_MODEL_ROOTS": str(models),
        "FERRY_DATA_ROOTS": str(data),
        **({"FERRY_DEVICES": "cpu"} if args.cpu else {}),
    }
    server, url = local_server.start_server(root, settings)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            result = follow(client, yaml.safe_dump(job_spec(args.cpu), sort_keys=False), args.timeout)
    finally:
        server.terminate()
        server.wait(timeout=30)
    clock["total_s"] = time.perf_counter() - started
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "commit": commit(),
        "parameters": parameters,
        "tokenizer_vocab": vocab,
        "clock": clock,
        **result,
    }


def follow(client: httpx.Client, spec: str, timeout: float) -> dict[str, Any]:
    posted = time.monotonic()
    answer = client.post("/v1/jobs", content=spec, headers={"content-type": "application/yaml"})
    answer.raise_for_status()
    job_id = answer.json()["id"]
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        if time.monotonic() - posted > timeout:
            client.post(f"/v1/jobs/{job_id}/cancel")
            break
        time.sleep(1)
    base = f"/v1/jobs/{job_id}"
    metrics = client.get(f"{base}/metrics", params={"limit": 10_000}).json()
    events = client.get(f"{base}/events", params={"limit": 1000}).json()["data"]
    logs = [e["data"]["message"] for e in events if e["type"] == "log"]
    steps = metrics["data"]
    step_times = [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(steps)]
    return {
        "job_id": job_id,
        "status": job["status"],
        "error": job.get("error"),
        "wall_s": time.monotonic() - posted,
        "logs": logs,
        "losses": [(s["step"], s["loss"]) for s in steps],
        "median_step_s": statistics.median(step_times) if step_times else None,
        "peak_gpu_bytes": max((s["device_peak_bytes"] for s in steps), default=0),
        "peak_reserved_bytes": max((s["device_reserved_bytes"] for s in steps), default=0),
        "pinned_bytes": max((s["pinned_bytes"] for s in steps), default=0),
        "eval": [(e["step"], e["eval_loss"], e["perplexity"]) for e in metrics["eval"]],
        "samples": [(s["step"], s["prompt"], s["text"]) for s in client.get(f"{base}/samples").json()["data"]],
        "checkpoints": [
            {"name": c["name"], "eval_loss": c["eval_loss"], "best": c["best"]}
            for c in client.get(f"{base}/checkpoints").json()["data"]
        ],
    }


def markdown(result: dict[str, Any], command: str) -> str:
    gib = 2**30
    lines = [
        f"{result['date']} — {result['gpu']} — torch {result['torch']}, transformers {result['transformers']} — "
        f"commit {result['commit']}",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Model: Llama config with {result['parameters'] / 1e9:.2f}B parameters (random init, bf16), LoRA rank 16 on "
        f"every projection; tokenizer: byte-level BPE of {result['tokenizer_vocab']} tokens trained in the run; "
        f"job {result['job_id']} {result['status']} in {result['wall_s']:.1f} s from POST.",
        "",
        "| step | train loss | eval loss | perplexity |",
        "|---|---|---|---|",
    ]
    train = dict(result["losses"])
    for step, loss, ppl in result["eval"]:
        lines.append(f"| {step} | {train.get(step, float('nan')):.4f} | {loss:.4f} | {ppl:.1f} |")
    lines += [
        "",
        f"Median step {result['median_step_s'] or 0:.3f} s; peak GPU allocated {result['peak_gpu_bytes'] / gib:.2f} GiB, "
        f"reserved {result['peak_reserved_bytes'] / gib:.2f} GiB; pinned host {result['pinned_bytes'] / gib:.2f} GiB.",
        "",
        "Samples (`GET /v1/jobs/{id}/samples`, what the job page shows):",
        "",
    ]
    lines += [f"- step {step}: {prompt!r} → {text!r}" for step, prompt, text in result["samples"]]
    lines += [
        "",
        "Checkpoints: "
        + ", ".join(f"{c['name']} (eval {c['eval_loss']}, best {c['best']})" for c in result["checkpoints"]),
    ]
    lines += ["", "Job log lines: " + " / ".join(result["logs"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cpu", action="store_true", help="a tiny config on the CPU")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the job may run")
    args = parser.parse_args()
    result = run(args)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    # The folder's name only: the document names no path of the machine that ran it.
    command = (
        f"python bench/llm_chat_e2e.py {'--cpu ' if args.cpu else ''}--out {args.out.name} --timeout {args.timeout:g}"
    )
    text = markdown(result, command)
    (args.out / "section.md").write_text(text)
    print(text)
    return 0 if result["status"] == "succeeded" else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
