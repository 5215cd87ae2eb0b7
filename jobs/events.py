"""The job event contract: every event a training job reports, typed, and the codes a failure may carry.

The runner (and anything it calls) emits these models through its ``report`` callback; the service's child
process serializes them with `event_to_wire` into the store; the store and scheduler read them back with
`parse_job_event` and act on their types; the API publishes the same models, so ``/openapi.json`` describes
every field. An event or error code not declared here cannot be produced: the models refuse unknown types,
fields and codes.

Example:
    >>> event = StepEvent(step=1, total_steps=10, loss=0.5, lr=1e-4, samples_per_s=8.0, elapsed_s=0.1, eta_s=0.9)
    >>> parse_job_event(event_to_wire(event)) == event
    True
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from jobs.errors import DiskFullError, JobSpecError, OutOfMemoryHint, RankLost
from offload import OffloadStats


class ErrorCode(str, Enum):
    """Every value a job's ``error.code`` takes (the failed event's ``error`` and the API's ``error.code``)."""

    OUT_OF_MEMORY = "out_of_memory"  # the device ran out of memory; the message names the setting that helps
    INVALID_SPEC = "invalid_spec"  # the spec was refused when the job's process loaded it
    DISK_FULL = "disk_full"  # the disk filled while a checkpoint was written; the message names the directory
    TRAINING_ERROR = "training_error"  # any other exception in the job (its class is the event's ``exception``)
    INTERRUPTED = "interrupted"  # the process vanished more often than the service retries (set by the service)
    LAUNCH_FAILED = "launch_failed"  # the service could not start the job's process (set by the service)

    @classmethod
    def from_stored(cls, value: str) -> ErrorCode:
        """Read a code a store may hold from before this contract (a class name such as ``ValueError``)."""
        if value in cls._value2member_map_:
            return cls(value)
        return cls.OUT_OF_MEMORY if value == "OutOfMemoryHint" else cls.TRAINING_ERROR


def error_code_for(error: BaseException) -> ErrorCode:
    """The code for an exception a job raised."""
    if isinstance(error, OutOfMemoryHint):
        return ErrorCode.OUT_OF_MEMORY
    if isinstance(error, JobSpecError):
        return ErrorCode.INVALID_SPEC
    if isinstance(error, DiskFullError):
        return ErrorCode.DISK_FULL
    if isinstance(error, RankLost):
        return ErrorCode.INTERRUPTED  # the service resumes the job from its last checkpoint
    return ErrorCode.TRAINING_ERROR


class JobEvent(BaseModel):
    """Base of every job event: immutable, no undeclared field."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceInfo(BaseModel):
    """The device a job trains on, as its own process sees it (``nvidia-smi --query-gpu=uuid`` for uuid)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(description="'cpu' or 'cuda'")
    name: str | None = None
    uuid: str | None = None
    visible_devices: int | None = None
    memory_total_bytes: int | None = None
    cuda_visible_devices: str | None = None


class LoadStats(BaseModel):
    """How the model's weights were loaded: straight into the offload engine's pinned arena (``safetensors``,
    ``random``, ``seeded_init``) or built in ordinary memory (``in_memory``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    bytes: int = Field(description="weight bytes loaded")
    seconds: float = Field(description="wall time of the load")
    gb_per_s: float
    peak_host_rss_bytes: int = Field(description="the job process's peak resident memory up to here")
    quantized: str | None = Field(None, description="model.quantize applied as the weights loaded (nf4, int8)")
    stored_bytes: int | None = Field(None, description="quantized: bytes written into the pinned arena")
    quantize_seconds: float | None = Field(
        None, description="quantized: time inside the quantization kernels, summed over the loader's threads"
    )


class StartedEvent(JobEvent):
    """The attempt has set up and is about to train."""

    type: Literal["started"] = "started"
    total_steps: int
    resumed_from_step: int | None = Field(None, description="the checkpoint's step when resuming")
    spec: dict[str, Any] = Field(description="the resolved job spec")
    device: DeviceInfo
    load: LoadStats | None = Field(None, description="how the weights were loaded")


class StepMetrics(BaseModel):
    """Training figures of one optimizer step."""

    loss: float
    lr: float
    samples_per_s: float
    tokens_per_s: float | None = None


class MemorySnapshot(BaseModel):
    """Memory after a step: PyTorch's device allocator (0 on the CPU; ``*_peak_*`` since the job started), the
    process RSS, the pinned arena."""

    device_allocated_bytes: int = 0
    device_reserved_bytes: int = 0
    device_peak_bytes: int = 0
    device_peak_reserved_bytes: int = 0
    host_rss_bytes: int = 0
    pinned_bytes: int = 0


class PreferenceMetrics(BaseModel):
    """A dpo or orpo step's figures, TRL's ``rewards/*`` and ``logps/*`` (means over the step's pairs).

    DPO's reward is ``beta * (log p_policy - log p_reference)`` of a completion (log-probs summed over its
    tokens); ORPO's is ``beta`` times the completion's mean per-token log-prob. ``logps_*`` are the policy's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rewards_chosen: float
    rewards_rejected: float
    rewards_accuracies: float = Field(description="share of pairs whose chosen reward beats the rejected one")
    rewards_margins: float
    logps_chosen: float
    logps_rejected: float


class GRPOMetrics(BaseModel):
    """A grpo step's figures, TRL's names: the rewards of the step's completions, their length in tokens, the
    KL to the reference (beta > 0) and the share of completion tokens whose ratio was clipped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reward_mean: float
    reward_std: float
    frac_reward_zero_std: float = Field(description="share of completions whose group's rewards were all equal")
    completion_length: float
    clip_ratio: float
    kl: float | None = Field(None, description="mean per-token k3 KL to the reference; null when beta is 0")
    generated_tokens: int | None = Field(None, description="completion tokens the step sampled (stops included)")
    generation_s: float | None = Field(None, description="seconds the step spent sampling its completions")
    generation_tokens_per_s: float | None = Field(None, description="generated_tokens / generation_s")
    generation_units_kept: int | None = Field(
        None,
        description="model offload: streamed units the decode loop held on the device for all its steps (copied "
        "once, not once per decode step); the others streamed per step",
    )
    training_s: float | None = Field(
        None, description="seconds of the step's training pass (forward, backward, update)"
    )
    training_tokens_per_s: float | None = Field(
        None, description="prompt and completion tokens the loss read, over training_s"
    )


class RankFigures(BaseModel):
    """One rank's share of a data-parallel step: its own step time and memory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    step_s: float
    device_peak_bytes: int
    device_allocated_bytes: int
    host_rss_bytes: int
    optimizer_host_bytes: int = Field(
        0, description="the rank's CPU optimizer state (optimizer offload): its part when the ranks split it"
    )


class StepEvent(JobEvent, StepMetrics, MemorySnapshot):
    """One optimizer step finished. Flat on the wire: metrics, memory, then the engine's own figures."""

    type: Literal["step"] = "step"
    step: int
    total_steps: int
    elapsed_s: float
    eta_s: float
    offload: OffloadStats | None = Field(None, description="the offload engine's counters; null without offload")
    preference: PreferenceMetrics | None = Field(None, description="training.objective dpo/orpo; null for sft")
    grpo: GRPOMetrics | None = Field(None, description="training.objective grpo: rewards, KL, length, clipping")
    ranks: list[RankFigures] | None = Field(
        None, description="distributed.world_size > 1: every rank's step time and memory; null on one rank"
    )


class EvalEvent(JobEvent):
    """An evaluation pass finished."""

    type: Literal["eval"] = "eval"
    step: int
    eval_loss: float
    perplexity: float | None = Field(None, description="exp(eval_loss) of a token-weighted loss; null for dpo/orpo")
    preference: PreferenceMetrics | None = Field(
        None, description="training.objective dpo/orpo: the eval pairs' means; null for sft"
    )
    metrics: dict[str, float] = Field(default_factory=dict, description="further named figures, e.g. accuracy")


class FileDigest(BaseModel):
    """One file of a checkpoint, as its manifest records it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bytes: int
    sha256: str


class CheckpointEvent(JobEvent):
    """A checkpoint was written (atomically) under the job's output directory."""

    type: Literal["checkpoint"] = "checkpoint"
    step: int
    name: str
    path: str
    files: list[FileDigest]


class ExportEvent(JobEvent):
    """An export the spec's ``export:`` section asked for was written from a checkpoint, after training."""

    type: Literal["export"] = "export"
    checkpoint: str = Field(description="the checkpoint exported, e.g. step-00000100")
    format: Literal["gguf", "merged"]
    quant: str | None = Field(None, description="of a GGUF file: f32, f16, bf16, q8_0 or q4_k_m")
    files: list[FileDigest] = Field(description="names relative to the job's output directory")
    note: str | None = Field(None, description="what the export changed, e.g. a quantized base merged in bf16")


class SampleEvent(JobEvent):
    """A sample the model produced: generated text, or a file (an image, audio) under the output directory."""

    type: Literal["sample"] = "sample"
    step: int
    prompt: str | None = None
    text: str | None = None
    artifact_path: str | None = Field(None, description="relative to the job's output directory")
    media_type: str | None = Field(None, description="of the artifact, e.g. image/png")
    reward: float | None = Field(None, description="grpo: the graders' reward of this completion of the prompt")

    @model_validator(mode="after")
    def _check_text_or_artifact(self) -> SampleEvent:
        if self.text is None and self.artifact_path is None:
            raise ValueError("a sample event carries text or an artifact_path")
        return self


class CacheProgressEvent(JobEvent, MemorySnapshot):
    """A ``task: cache`` job encoded another sample (``step`` of ``total_steps`` samples)."""

    type: Literal["cache_progress"] = "cache_progress"
    step: int
    total_steps: int
    samples_per_s: float
    elapsed_s: float
    eta_s: float
    text_encoder_s: float = Field(description="seconds in the text encoder so far")
    vae_s: float = Field(description="seconds in the VAE so far")


class LogEvent(JobEvent):
    """A message for the user, e.g. a setting that is skipped."""

    type: Literal["log"] = "log"
    level: Literal["debug", "info", "warning", "error"] = "info"
    message: str


class FinishedEvent(JobEvent):
    """The attempt ended by itself: trained to the end, paused (after a checkpoint) or cancelled."""

    type: Literal["finished"] = "finished"
    status: Literal["succeeded", "paused", "cancelled"]
    step: int


class FailedEvent(JobEvent):
    """The attempt raised; ``error`` is the code, ``message`` a sentence naming the fix where there is one."""

    type: Literal["failed"] = "failed"
    error: ErrorCode
    message: str
    exception: str | None = Field(None, description="the exception's class, e.g. ValueError")


JOB_EVENTS: tuple[type[JobEvent], ...] = (
    StartedEvent,
    StepEvent,
    EvalEvent,
    CheckpointEvent,
    ExportEvent,
    SampleEvent,
    CacheProgressEvent,
    LogEvent,
    FinishedEvent,
    FailedEvent,
)
EVENT_TYPES: dict[str, type[JobEvent]] = {cls.model_fields["type"].default: cls for cls in JOB_EVENTS}
AnyJobEvent = Annotated[
    StartedEvent
    | StepEvent
    | EvalEvent
    | CheckpointEvent
    | ExportEvent
    | SampleEvent
    | CacheProgressEvent
    | LogEvent
    | FinishedEvent
    | FailedEvent,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(AnyJobEvent)


def event_to_wire(event: JobEvent) -> dict[str, Any]:
    """The JSON-able form of a declared event (what the store keeps). Anything else is refused."""
    if type(event) not in JOB_EVENTS:
        raise TypeError(f"not a declared job event: {event!r} (jobs/events.py lists them)")
    return event.model_dump(mode="json")


def parse_job_event(data: dict[str, Any]) -> JobEvent:
    """The typed event of a wire dict; raises pydantic's ValidationError for an undeclared type or field."""
    return _ADAPTER.validate_python(data)


def failed_event(error: BaseException) -> FailedEvent:
    """The failed event for an exception a job raised."""
    return FailedEvent(
        error=error_code_for(error), message=str(error) or type(error).__name__, exception=type(error).__name__
    )


class Report(Protocol):
    """Where a job's events go: the ``report`` callback of `jobs.run_job` and of every task a family runs.

    Any callable taking one event fits (``print`` too); `jobs.reporting.tracking.Tracking` is one that also
    writes metrics to the trackers.
    """

    def __call__(self, event: JobEvent, /) -> None: ...


class StopPoll(Protocol):
    """Asked between steps whether the job should stop: ``"pause"`` (checkpoint first), ``"cancel"`` or None."""

    def __call__(self) -> Literal["pause", "cancel"] | None: ...
