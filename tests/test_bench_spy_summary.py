"""bench/spy_summary.py reads py-spy's raw stacks of a training job: per thread, the samples inside the training
steps by area, and the engine's own work apart from the model code its hooks call into."""

from __future__ import annotations

from pathlib import Path

from bench.spy_summary import BACKWARD, ENGINE, MAIN, summarize, tally

STEP = "thread (10): MainThread;<module> (bench/diffusion_profile.py:1);train_step (jobs/train/runner.py:66)"
BACKWARD_ROOT = "thread (11);BackwardCFunction.apply (torch/autograd/function.py:317)"
RAW = "\n".join(
    [
        f"{STEP};Linear.forward (torch/nn/modules/linear.py:134) 5",
        f"{STEP};_onload_before_forward (offload/manager.py:259);wait_event (torch/cuda/streams.py:90) 2",
        # The engine's saved-tensor hook recomputing a block: the model's time, not the engine's.
        f"{BACKWARD_ROOT};unpack (offload/saved_tensors.py:135);unpack_hook (torch/utils/checkpoint.py:1);"
        "forward (diffusers/models/transformers/transformer_qwenimage.py:700) 3",
        f"{BACKWARD_ROOT};_engine_run_backward (torch/autograd/graph.py:869) 4",
        "thread (10): MainThread;<module> (bench/diffusion_profile.py:1);load (jobs/models/diffusion/model.py:9) 50",
        "thread (12): ThreadPoolExecutor-0_0;fill (jobs/models/diffusion/components.py:112) 40",
    ]
)


def test_samples_outside_the_steps_are_left_out_and_the_engine_keeps_only_its_own_work() -> None:
    by_thread, engine, _ = tally(RAW)
    assert sum(by_thread[MAIN].values()) - by_thread[MAIN][ENGINE] == 7
    assert by_thread[MAIN][ENGINE] == 2 and by_thread[MAIN]["offload (engine)"] == 0  # its torch call is its own
    assert sum(by_thread[BACKWARD].values()) == 7 and by_thread[BACKWARD][ENGINE] == 0
    assert by_thread[BACKWARD]["diffusers"] == 3
    assert list(engine) == ["_onload_before_forward (offload/manager.py:259)"]


def test_the_summary_gives_each_threads_shares(tmp_path: Path) -> None:
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    text = summarize(path)
    assert text.splitlines()[0].endswith("14 samples in the training steps")
    assert "engine (own work)                2   28.6%" in text
