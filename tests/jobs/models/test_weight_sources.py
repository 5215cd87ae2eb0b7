"""Loading straight into the pinned arena: a model on the meta device, its host copies filled in place.

Bitwise the same weights as the ordinary load, for the built-in model (seeded init and weights file) and for
a sharded Hugging Face checkpoint; a peak RSS near the weights alone (the ordinary load holds them twice);
seeded random init for configs without weights; and the whole job path reporting its load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from jobs import PathRoots, run_job
from jobs.events import StartedEvent, StepEvent
from jobs.models.loading.weight_sources import RandomSource, SafetensorsSource
from jobs.models.transformer_lm import TransformerLMSpec, build_transformer_lm, build_transformer_lm_on_meta
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.helpers import TINY_LM, merged, spec_from

LM = {k: v for k, v in TINY_LM["model"].items() if k != "kind"} | {"dtype": "bfloat16"}


def through_the_engine(model: torch.nn.Module, source: object, **kwargs: object) -> dict[str, torch.Tensor]:
    """Attach the engine with ``initialize=source.fill``, wait for the fill, detach: the values it holds."""
    model.requires_grad_(False)
    manager = OffloadTrainingManager(model, "cpu", initialize=source.fill, **kwargs)  # type: ignore[attr-defined]
    source.finish()  # type: ignore[attr-defined]
    assert all(not t.is_meta for t in model.state_dict().values())
    manager.remove()
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_builtin_seeded_init_is_bitwise_the_ordinary_build(granularity: str) -> None:
    spec = TransformerLMSpec(kind="transformer_lm", **LM)
    ordinary = build_transformer_lm(spec, seed=3).state_dict()
    model, source = build_transformer_lm_on_meta(spec, 3, torch.device("cpu"))
    assert all(p.is_meta for p in model.parameters())
    assert_bitwise_equal(through_the_engine(model, source, options=OffloadOptions(granularity=granularity)), ordinary)


def test_builtin_weights_file_is_read_bitwise_into_pinned_copies(tmp_path: Path) -> None:
    spec = TransformerLMSpec(kind="transformer_lm", **LM)
    weights = {k: v.to(torch.float32) for k, v in build_transformer_lm(spec, seed=5).state_dict().items()}
    save_file(weights, str(tmp_path / "w.safetensors"))  # float32 on disk: converted while loading
    file_spec = TransformerLMSpec(kind="transformer_lm", **LM, weights=tmp_path / "w.safetensors")
    ordinary = build_transformer_lm(file_spec, seed=0).state_dict()
    model, source = build_transformer_lm_on_meta(file_spec, 0, torch.device("cpu"))
    assert isinstance(source, SafetensorsSource)
    assert_bitwise_equal(through_the_engine(model, source), ordinary)


def save_tiny_qwen(directory: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="100KB")  # several shards and an index


def test_sharded_hf_checkpoint_is_bitwise_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from jobs.models.hf_causal_lm import HFCausalLMSpec, build_hf_causal_lm_on_meta

    save_tiny_qwen(tmp_path / "qwen")
    assert (tmp_path / "qwen" / "model.safetensors.index.json").is_file()
    ordinary = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen", dtype=torch.bfloat16).state_dict()
    spec = HFCausalLMSpec(kind="hf_causal_lm", path=tmp_path / "qwen")
    model, source = build_hf_causal_lm_on_meta(spec, 0, torch.device("cpu"))
    assert_bitwise_equal(through_the_engine(model, source), ordinary)


def test_random_init_is_seeded_and_shaped_like_a_fresh_model() -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip

    def load(seed: int) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        return through_the_engine(model, RandomSource(model, seed, 0.02, torch.device("cpu")))

    first, again, other = load(1), load(1), load(2)
    assert_bitwise_equal(first, again)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(first[weight], other[weight])
    assert abs(first[weight].float().std().item() - 0.02) < 0.002
    assert torch.all(first["model.norm.weight"] == 1)


def test_meta_load_peak_rss_is_the_weights_once(tmp_path: Path) -> None:
    """In a fresh process: loading 190 MiB of weights into pinned copies raises the peak RSS by about
    that much; the ordinary load (safetensors into memory, then the engine's copy) by about twice that."""
    script = textwrap.dedent(
        f"""
        import json, resource, sys, torch, numpy  # imports are not what is measured
        from safetensors.torch import save_file
        from jobs.models.transformer_lm import TransformerLMSpec
        from jobs.models.transformer_lm import build_transformer_lm, build_transformer_lm_on_meta
        from offload import OffloadTrainingManager
        spec = TransformerLMSpec(kind="transformer_lm", vocab_size=257, hidden_size=1024, num_layers=8,
                                 num_heads=8, max_seq_len=64, dtype="bfloat16", weights="{tmp_path}/w.safetensors")
        if sys.argv[1] == "write":
            spec0 = spec.model_copy(update={{"weights": None}})
            save_file(build_transformer_lm(spec0, 0).state_dict(), "{tmp_path}/w.safetensors")
            sys.exit(0)
        def status(field):  # /proc/self/status, in bytes
            line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
            return int(line.split()[1]) * 1024
        build_transformer_lm_on_meta(spec, 0, torch.device("cpu"))  # lazy imports and thread pools: not measured
        open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from what is resident now
        base = status("VmRSS")
        def rss(): return status("VmHWM")
        if sys.argv[1] == "meta":
            model, source = build_transformer_lm_on_meta(spec, 0, torch.device("cpu"))
            model.requires_grad_(False)
            OffloadTrainingManager(model, "cpu", initialize=source.fill); source.finish()
        else:
            model = build_transformer_lm(spec, 0); model.requires_grad_(False)
            OffloadTrainingManager(model, "cpu")
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(json.dumps({{"growth": rss() - base, "weights": nbytes}}))
        """
    )
    (tmp_path / "probe.py").write_text(script)
    root = Path(__file__).parents[3]

    def probe(mode: str) -> dict[str, int]:
        done = subprocess.run(
            [sys.executable, str(tmp_path / "probe.py"), mode], capture_output=True, text=True, cwd=root,
            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1]) if mode != "write" else {}

    probe("write")
    meta, ordinary = probe("meta"), probe("ordinary")
    assert meta["weights"] > 150 * 2**20
    assert meta["growth"] <= 1.15 * meta["weights"]
    assert ordinary["growth"] >= 1.4 * ordinary["weights"]  # what the meta path saves (1.5x measured)


def test_a_job_loads_a_random_hf_model_into_pinned_memory_and_reports_it(tmp_path: Path, roots: PathRoots) -> None:
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(roots.model_roots[0] / "qwen-config")  # fmt: skip
    data = merged(
        {**TINY_LM, "model": {"kind": "hf_causal_lm", "path": "qwen-config", "init": "random"}},
        lora={"target_modules": ["q_proj", "v_proj"], "rank": 4},
        offload={"enable_model_cpu_offload": True, "granularity": "block"},
        training={"steps": 2, "gradient_checkpointing": True},
    )
    events: list = []
    run_job(spec_from(data, roots), output_dir=tmp_path / "out", report=events.append)
    started = next(e for e in events if isinstance(e, StartedEvent))
    assert started.load is not None and started.load.source == "random"
    assert started.load.bytes > 300 * 64 * 2 and started.load.peak_host_rss_bytes > 0
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(e.loss)) for e in steps)
    assert steps[-1].offload is not None and steps[-1].offload.ring_overflows == 0
    assert json.loads(json.dumps(started.model_dump(mode="json")))["load"]["gb_per_s"] >= 0
