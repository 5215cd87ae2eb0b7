"""``model.uncheckpointed_layers``: the last decoder layers keep their activations instead of being recomputed.

Under gradient checkpointing every layer's forward runs twice a step. Where the device has memory to spare (a
step bound by compute, not by copies), leaving the last layers whole saves their recompute: the same losses and
gradients, one forward of those layers less, their activations in memory, counted by the fit check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobs import PathRoots, estimate_memory, run_job
from jobs.errors import JobSpecError
from jobs.events import StepEvent
from tests.jobs.helpers import merged, spec_from
from tests.jobs.models.test_hf_causal_lm import TINY_HF, save_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")

CHECKPOINTED = {"gradient_checkpointing": True}


def _layer_calls(
    tmp_path: Path, roots: PathRoots, offload: dict[str, Any], whole: int
) -> tuple[list[float], list[int]]:
    """The job's losses, and how often each decoder layer's forward ran in its last step."""
    # Counted in the attention, as a layer's own forward carries transformers' checkpointing wrapper.
    from transformers.models.llama.modeling_llama import LlamaAttention

    calls: list[int] = [0, 0]
    original = LlamaAttention.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[self.layer_idx] += 1
        return original(self, *args, **kwargs)

    data = merged(TINY_HF, training=CHECKPOINTED, offload=offload, model={"uncheckpointed_layers": whole},
                  checkpoint={"save_final": False})  # fmt: skip
    events: list[Any] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaAttention, "forward", counted)
        run_job(spec_from(data, roots), output_dir=tmp_path / f"{whole}-{bool(offload)}", report=events.append)
    steps = [e.loss for e in events if isinstance(e, StepEvent)]
    return steps, [n // len(steps) for n in calls]


@pytest.mark.parametrize(
    "offload", [{"enable_model_cpu_offload": False}, {"enable_model_cpu_offload": True, "granularity": "block"}]
)
def test_the_last_layers_are_not_recomputed_and_train_alike(
    tmp_path: Path, roots: PathRoots, offload: dict[str, Any]
) -> None:
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    losses, calls = _layer_calls(tmp_path, roots, offload, whole=0)
    kept_losses, kept_calls = _layer_calls(tmp_path, roots, offload, whole=1)
    assert calls == [2, 2] and kept_calls == [2, 1]  # the last layer runs its forward once a step
    assert len(losses) == 4 and kept_losses == losses
    everything = _layer_calls(tmp_path, roots, offload, whole=5)[1]  # more than the model has: every layer
    assert everything == [1, 1]


def test_the_fit_check_counts_what_the_whole_layers_keep(roots: PathRoots) -> None:
    from jobs.models.hf_causal_lm import hf_checkpointed_inputs, meta_hf_causal_lm

    save_tiny_llama(roots.model_roots[0] / "tiny-llama")

    def spec(whole: int) -> Any:
        return spec_from(merged(TINY_HF, training=CHECKPOINTED, model={"uncheckpointed_layers": whole}), roots)

    model = meta_hf_causal_lm(spec(0).model)  # type: ignore[arg-type]
    assert len(hf_checkpointed_inputs(spec(0), model)) == 2 and len(hf_checkpointed_inputs(spec(1), model)) == 1
    peaks = [estimate_memory(spec(n)).peak_device_bytes for n in (0, 1, 2)]
    assert peaks[0] < peaks[1] < peaks[2]  # a whole layer keeps more than its input


def test_whole_layers_without_checkpointing_are_refused(roots: PathRoots) -> None:
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    with pytest.raises(JobSpecError) as refused:
        spec_from(
            merged(TINY_HF, training={"gradient_checkpointing": False}, model={"uncheckpointed_layers": 1}), roots
        )
    assert [(p.path, p.message) for p in refused.value.problems] == [
        (
            "model.uncheckpointed_layers",
            "keeps layers out of gradient checkpointing, which is off; set training.gradient_checkpointing: true "
            "or remove it",
        )
    ]
