"""bench/diffusion_bench.py's bookkeeping: its RESULTS.md section and the rounds it pools (no GPU, no model)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import diffusion_bench


def test_writing_the_section_keeps_the_notes_below_it_and_the_other_sections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# Benchmark results\n\n## Offload engine\n\nengine table\n\n"
        f"{diffusion_bench.SECTION}\n\nold generated table\n\n### Issue 16: a note written by hand\n\nkept\n\n"
        "<!-- dashboard_mix:start -->\n## Service\n\nservice table\n"
    )
    monkeypatch.setattr(diffusion_bench, "RESULTS", results)
    diffusion_bench.write_section(f"{diffusion_bench.SECTION}\n\nnew generated table\n")
    text = results.read_text()
    assert "old generated table" not in text and "new generated table" in text
    assert "### Issue 16: a note written by hand\n\nkept" in text, "the hand-written subsection was overwritten"
    assert text.index("new generated table") < text.index("### Issue 16")
    assert "engine table" in text and "service table" in text


def _round(steps: list[float], alloc_gib: float, reserved_gib: float) -> dict:
    """One round's row as step_figures gives it (the fields pool_rounds reads)."""
    return {
        "steps_s": steps,
        "step_s": steps[len(steps) // 2],
        "min_step_s": min(steps),
        "peak_alloc_gib": alloc_gib,
        "peak_reserved_gib": reserved_gib,
    }


def test_rounds_pool_every_step_and_keep_each_rounds_median() -> None:
    first, second = _round([1.0, 1.2, 1.4], 2.0, 3.0), _round([2.0, 2.2, 2.4], 2.5, 2.9)
    pooled = diffusion_bench.pool_rounds([first, second])
    assert pooled["steps_s"] == [1.0, 1.2, 1.4, 2.0, 2.2, 2.4]
    assert pooled["step_s"] == pytest.approx(1.7) and pooled["min_step_s"] == 1.0
    assert (pooled["peak_alloc_gib"], pooled["peak_reserved_gib"]) == (2.5, 3.0)
    assert pooled["round_medians_s"] == [1.2, 2.2]


def test_the_link_busy_row_is_set_beside_the_resident_step() -> None:
    """The resident job under background copies is reported as a ratio to the resident step of the same run."""
    from types import SimpleNamespace

    resident = {**_round([1.0, 1.2, 1.4], 40.0, 41.0), "label": "no offload", "pinned_gib": 0.0, "h2d_gb": 0.0}
    busy = {**resident, "label": "link busy", "step_s": 1.5, "load_gbps": 53.2}
    args = SimpleNamespace(
        family="qwen_image", steps=4, seed_steps=2, prompts=4, limit="24GiB", budget="14GiB", service=False, service_rows="ferry",
        only="resident,resident-link-busy", rounds=1, build_each=False,
    )  # fmt: skip
    report = diffusion_bench.render(
        {"resident": resident, "resident-link-busy": busy},
        {},
        None,
        h2d=55.0,
        weights=10**9,
        weight_bytes=2 * 10**9,
        modulation_bytes=0,
        args=args,
        device="cpu",
    )
    assert "the resident step 1.20 s alone, 1.50 s while host-to-device copies ran" in report
    assert "at 53 GB/s (1.25x)" in report


def test_background_copies_refuse_an_unknown_direction() -> None:
    from bench.copy_load import BackgroundCopies

    with pytest.raises(ValueError, match="directions must be some of 'h2d', 'd2h'"):
        BackgroundCopies(directions=("sideways",))


def test_background_copies_say_so_when_their_process_cannot_copy() -> None:
    """The copies run in a process of their own; one that fails (no CUDA device) is an error at once, not a wait
    for a load that never starts."""
    from bench.copy_load import BackgroundCopies

    with pytest.raises(RuntimeError, match="exited .* before copying"):
        BackgroundCopies(directions=("h2d",), device="cpu", timeout=60)


def test_ferry_with_the_modulation_table_is_set_beside_the_same_schedule_streaming_it() -> None:
    """Each row's copy floor counts what it streams: Ferry's not the modulation layers, the A/B row all of them."""
    from types import SimpleNamespace

    def row(label: str, step: float, h2d_gb: float) -> dict:
        figures = {**_round([step, step], 20.0, 21.0), "label": label, "pinned_gib": 1.0, "h2d_gb": h2d_gb}
        return {
            **figures,
            "round_medians_s": [step],
            "h2d_gbps_steps": [55.0],
            "copy_wait_steps": [0.0],
            "reused_gb": 0,
        }

    rows = {
        "resident": row("no offload", 1.0, 0.0),
        "ferry": row("ferry", 1.1, 24.0),
        "ferry-streamed-modulation": row("streamed", 1.4, 50.0),
    }
    args = SimpleNamespace(
        family="qwen_image", steps=4, seed_steps=2, prompts=4, limit="24GiB", budget="10GB", service=False, service_rows="ferry",
        only="resident,ferry,ferry-streamed-modulation", rounds=1, build_each=False,
    )  # fmt: skip
    report = diffusion_bench.render(
        rows, {}, None, h2d=50.0, weights=20 * 10**9, weight_bytes=40 * 10**9, modulation_bytes=14 * 10**9,
        args=args, device="cpu",
    )  # fmt: skip
    # Floors: (40 - 10) GB twice at 50 GB/s = 1.20 s streamed, (40 - 14 - 10) GB twice = 0.64 s with the table.
    assert (
        "with 10GB kept resident 1.20 s, and without the 14.0 GB of modulation layers the table replaces 0.64 s"
        in report
    )
    assert "| ferry | 1.10 | 1.10x | 1.72x |" in report and "| streamed | 1.40 | 1.40x | 1.17x |" in report
    assert (
        "Ferry 1.10 s copying 24.0 GB per step; with the modulation layers streamed 1.40 s, 50.0 GB (0.79x)" in report
    )


FLUX_RUNS = {"flux1": "resident,ferry,seed", "flux2": "encoder,resident,ferry"}  # each family's --only


class BenchProcess:
    """One tiny run of a bench script, in a process of its own as a user runs it; its output goes to files, so
    a process nobody reads yet never waits on a full pipe."""

    def __init__(self, args: list[str], work: Path, env: dict[str, str] | None = None) -> None:
        import subprocess
        import sys

        self.work = work
        work.mkdir(parents=True)
        self.stdout, self.stderr = (work / "stdout.txt").open("w+"), (work / "stderr.txt").open("w+")
        root = Path(diffusion_bench.__file__).resolve().parents[1]
        self.process = subprocess.Popen(
            [sys.executable, *args], cwd=root, stdout=self.stdout, stderr=self.stderr, text=True, env=env
        )

    def wait(self, timeout: float = 300) -> tuple[int, str, str]:
        """The exit status, stdout and stderr once the process ended (killed past ``timeout``)."""
        import subprocess

        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stdout.seek(0)
        self.stderr.seek(0)
        return self.process.returncode, self.stdout.read(), self.stderr.read()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.stdout.close()
        self.stderr.close()


@pytest.fixture(scope="module")
def flux_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The bench's --cpu run of each Flux family this session tests, all started at once when the first is
    needed: each is its own process, and on a small machine one's imports overlap the other's steps."""
    wanted = {
        item.callspec.params["family"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_a_flux_family_runs_tiny_on_the_cpu_beside_the_resident_step_and_the_seed"
    }  # fmt: skip
    runs = {}
    for family in sorted(wanted):
        work = tmp_path_factory.mktemp(f"bench-{family}")
        args = ["bench/diffusion_bench.py", "--family", family, "--cpu", "--no-write", "--steps", "2",
                "--seed-steps", "2", "--prompts", "1", "--only", FLUX_RUNS[family], "--work", str(work / "run")]  # fmt: skip
        # One torch thread each: two processes of a thread per core on a small machine wait on each other's
        # threads for every op of these tiny models (test_multi_gpu_slots.py measured it).
        runs[family] = BenchProcess(args, work / "process", env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield runs
    for run in runs.values():
        run.close()


def _tiny_run(family: str, run: BenchProcess) -> dict:
    """The bench's --cpu run of ``family``'s rows, in a process of its own, as a user runs it; its results.json."""
    import json

    returncode, stdout, stderr = run.wait()
    assert returncode == 0, stderr[-3000:]
    results = json.loads((run.work.parent / "run" / "results.json").read_text())
    assert not results["failures"], results["failures"]
    heading = diffusion_bench.FAMILIES[family].section
    assert f"\n{heading}\n" in stdout, stdout[-2000:]
    return results


@pytest.mark.parametrize(("family", "only"), list(FLUX_RUNS.items()))
def test_a_flux_family_runs_tiny_on_the_cpu_beside_the_resident_step_and_the_seed(
    family: str, only: str, flux_runs: dict[str, BenchProcess]
) -> None:
    """Flux.2's run has the cache job's row instead of the seed's (the seed's schedule is the same for both)."""
    results = _tiny_run(family, flux_runs[family])
    assert set(results["rows"]) == set(only.split(",")) - {"encoder"}
    losses = {key: row["loss"] for key, row in results["rows"].items()}
    assert all(loss == pytest.approx(losses["resident"]) for loss in losses.values()), losses
    if family == "flux2":  # Flux.2's text encoder in the cache job: its prompts padded to 512 tokens
        assert results["encoder"]["samples"] == 1 and results["encoder"]["prompt_tokens"] == 512


def test_the_synthetic_caches_have_the_shapes_of_1024_squared_and_what_the_reader_expects(tmp_path: Path) -> None:
    """At full size: Flux.1's latents [16, 1, 128, 128] with T5's [512, 4096] and CLIP's pooled [768]; Flux.2's
    [128, 1, 64, 64] with [512, 15360]; each cache with the empty caption's embedding and its model's fingerprint."""
    from types import SimpleNamespace

    from jobs.models.diffusion.data.cache import CachedSamples, cache_problems_for_training

    want = {"flux1": ((16, 1, 128, 128), (512, 4096), (768,)), "flux2": ((128, 1, 64, 64), (512, 15360))}
    for family, shapes in want.items():
        pipeline = diffusion_bench.make_pipeline_dir(tmp_path / family, tiny=False, family=family)
        cache = tmp_path / f"cache-{family}"
        diffusion_bench.write_synthetic_cache(cache, pipeline, samples=1, side=1024, prompt_tokens=512)
        samples = CachedSamples(cache)
        assert tuple(tuple(t.shape) for t in samples.sample(0)) == shapes
        assert tuple(tuple(t.shape) for t in samples.empty_prompt() or ()) == shapes[1:]
        model = SimpleNamespace(
            path=pipeline, text_encoder_dtype=None, dtype="bfloat16", vae_dtype="bfloat16", init="random"
        )
        assert cache_problems_for_training(cache, model, caption_dropout=0.1) == []


def test_a_row_that_does_not_apply_to_the_family_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        diffusion_bench.parse_args(["--family", "flux1", "--only", "encoder,ferry,ferry-streamed-modulation"])
    assert "--only encoder: not a row of --family flux1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # Flux.2 has no per-block modulation to precompute
        diffusion_bench.parse_args(["--family", "flux2", "--only", "ferry,ferry-streamed-modulation"])
    assert "--only ferry-streamed-modulation: not a row of --family flux2" in capsys.readouterr().err
    args = diffusion_bench.parse_args(["--family", "flux2"])
    assert (args.limit, args.budget, args.only) == ("24GiB", "8GiB", "encoder,resident,ferry,seed")
    assert diffusion_bench.parse_args([]).budget == "14GiB"


def test_the_step_profile_runs_a_flux2_job_with_int8_frozen_weights(tmp_path: Path) -> None:
    """bench/diffusion_profile.py profiles any family's DiT, quantized or not: the tool for Flux.2's int8 step."""
    import json
    import os
    import subprocess
    import sys

    root = Path(diffusion_bench.__file__).resolve().parents[1]
    command = [sys.executable, "bench/diffusion_profile.py", "--tiny", "--steps", "2", "--family", "flux2",
               "--quantize", "int8"]  # fmt: skip
    done = subprocess.run(
        command, cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("FIGURES "))[8:])
    assert figures["family"] == "flux2" and figures["quantize"] == "int8" and len(figures["step_s"]) == 2


def test_the_int8_dequantization_probe_runs_tiny_on_the_cpu() -> None:
    """bench/int8_dequant_probe.py (the Flux.2 int8 kernel's figures in bench/RESULTS.md) runs and prints a row
    per shape; on the CPU both sides are torchao's eager ops, so only that it runs is checked."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    root = Path(diffusion_bench.__file__).resolve().parents[1]
    command = [sys.executable, "bench/int8_dequant_probe.py", "--device", "cpu", "--divide", "64", "--calls", "1"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line[2:3].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 864 x 96", "| 96 x 384", "| 96 x 96"]
