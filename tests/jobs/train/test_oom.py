"""The out-of-memory advice names the next setting to turn on."""

from __future__ import annotations

from jobs.train.oom import oom_advice, oom_message
from tests.jobs.helpers import TOY, merged, spec_from


def advice(**sections: object) -> str:
    return oom_advice(spec_from(merged(TOY, **sections)))


def test_advice_follows_the_expected_savings() -> None:
    assert advice().startswith("set offload.enable_model_cpu_offload: true")
    assert advice(offload={"enable_model_cpu_offload": True}).startswith(
        "set offload.enable_optimizer_cpu_offload: true"
    )
    both = {"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True}
    assert advice(offload={**both, "gpu_memory_budget": "1GiB"}).startswith("lower offload.gpu_memory_budget")
    assert advice(offload={**both, "gpu_memory_budget": "auto"}).startswith(
        "set offload.gpu_memory_budget to a size below what 'auto' chose"
    )
    assert advice(offload={**both, "gpu_memory_budget": None}).startswith("lower training.batch_size")
    assert advice(offload={**both, "prefetch": 3}).startswith("lower offload.prefetch")
    assert advice(offload=both).startswith("lower training.batch_size (now 8)")
    assert "lower model.hidden_size" in advice(offload=both, training={"batch_size": 1})


def test_message_quotes_the_error() -> None:
    message = oom_message(spec_from(TOY), 4, RuntimeError("CUDA out of memory. Tried to allocate 1 GiB\nmore"))
    assert message.startswith(
        "device out of memory at step 5: CUDA out of memory. Tried to allocate 1 GiB. To fit: set"
    )


def test_message_under_a_limit_names_it() -> None:
    spec = spec_from(merged(TOY, offload={"enable_model_cpu_offload": True, "gpu_memory_limit": "24GiB"}))
    message = oom_message(spec, 0, RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert message.startswith(
        "device out of memory at step 1 under offload.gpu_memory_limit=24GiB (24.00 GiB for this process)"
    )
    assert message.endswith("or raise offload.gpu_memory_limit.")
    assert "set offload.enable_optimizer_cpu_offload: true" in message
