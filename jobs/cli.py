"""Command line: ``python -m jobs run FILE [--output DIR]``, ``validate FILE``, ``estimate FILE``, ``schema``,
``merge CHECKPOINT [--output DIR]``, ``export CHECKPOINT --format gguf|lora [--quant Q] [--output FILE]``,
``import-axolotl FILE``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tqdm import tqdm

from jobs.errors import JobSpecError, OutOfMemoryHint, SpecProblem
from jobs.events import (
    CacheProgressEvent,
    CheckpointEvent,
    EvalEvent,
    FailedEvent,
    JobEvent,
    LogEvent,
    SampleEvent,
    StartedEvent,
    StepEvent,
)
from jobs.fit.checks import compile_problem, device_problem, host_limit_problem, host_memory_problem
from jobs.fit.estimate import estimate_memory
from jobs.paths import PathRoots, default_data_roots, default_model_roots
from jobs.spec.job import JobSpec
from jobs.spec.loading import job_spec_schema, line_of, load_job_spec
from jobs.spec.preflight import preflight_problems
from jobs.train.runner import run_job


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for an invalid spec, 1 for a failed run)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.command == "run" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "schema":
        print(json.dumps(job_spec_schema(), indent=2))
        return 0
    if args.command == "merge":
        return _merge(args)
    if args.command == "export":
        return _export(args)
    if args.command == "import-axolotl":
        return _import_axolotl(args.file)
    try:
        spec, text = _load(args)
    except (JobSpecError, OSError) as error:
        print(error, file=sys.stderr)
        return 2
    if args.command in ("validate", "run"):
        # The data's first rows and the model's module names (validate), and as the service checks at
        # submit: a GPU for device: cuda, the host memory the estimate needs.
        problems = preflight_problems(spec, _roots(args)) if args.command == "validate" else []
        if not args.no_fit_check:
            problems += machine_problems(spec, text)
        if problems:
            print(JobSpecError(problems), file=sys.stderr)
            return 2
    if args.command == "validate":
        print(f"ok: {spec.name} ({_length(spec)}, model {spec.model.kind}, device {spec.device})")
        return 0
    if args.command == "estimate":
        estimate = estimate_memory(spec)
        print(
            json.dumps(
                {
                    "peak_device_bytes": estimate.peak_device_bytes,
                    "pinned_host_bytes": estimate.pinned_host_bytes,
                    "optimizer_host_bytes": estimate.optimizer_host_bytes,
                    "ranks": estimate.ranks,
                    "notes": estimate.notes,
                },
                indent=2,
            )
        )
        return 0
    output = Path(args.output or Path("out") / spec.name)
    try:
        with _ProgressBar() as progress:
            outcome = run_job(spec, output_dir=output, report=progress, resume=not args.no_resume)
    except OutOfMemoryHint as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{outcome.status} at step {outcome.step}; checkpoint: {outcome.checkpoint}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs", description="Ferry training jobs from YAML specs.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "train a job"),
        ("validate", "check a spec and list every problem"),
        ("estimate", "estimate peak device memory and pinned host memory"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("file", type=Path, help="the YAML job spec")
        command.add_argument(
            "--model-root",
            action="append",
            type=Path,
            default=None,
            help="directory model paths must stay in (repeatable; default: the current directory and the "
            "service's default, ferry-data/models)",
        )
        command.add_argument(
            "--data-root",
            action="append",
            type=Path,
            default=None,
            help="directory data paths must stay in (repeatable; default: the current directory and the "
            "service's defaults, ferry-data/datasets and the bundled configs/data)",
        )
        if name != "estimate":
            command.add_argument(
                "--no-fit-check",
                action="store_true",
                help="skip the GPU and host-memory checks (the service's ?fit_check=false&queue_anyway=true)",
            )
        if name == "run":
            command.add_argument("--output", type=Path, help="output directory (default: out/<name>)")
            command.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    commands.add_parser("schema", help="print the JSON Schema of a job spec")
    merge = commands.add_parser("merge", help="merge a LoRA checkpoint into its base model (a full model directory)")
    merge.add_argument("checkpoint", type=Path, help="a checkpoint directory of a LoRA job")
    merge.add_argument("--output", type=Path, help="default: <output_dir>/exports/<checkpoint>-merged")
    merge.add_argument("--no-archive", action="store_true", help="do not also write <output>.tar")
    merge.add_argument(
        "--max-shard-size", default="5GB", help="the largest safetensors file, e.g. 5GB or 200MB (default: 5GB)"
    )
    export = commands.add_parser(
        "export", help="write a checkpoint in a format other programs load (gguf: llama.cpp, Ollama, LM Studio)"
    )
    export.add_argument("checkpoint", type=Path, help="a checkpoint directory (a LoRA one is merged first)")
    export.add_argument(
        "--format",
        choices=["gguf", "lora"],
        default="gguf",
        help="gguf (an LLM) or lora (a diffusion LoRA as one file ComfyUI and diffusers load; default: gguf)",
    )
    export.add_argument("--quant", default="f16", help="f32, f16, bf16, q8_0 or q4_k_m (default: f16)")
    export.add_argument("--output", type=Path, help="default: <output_dir>/exports/<checkpoint>-<quant>.gguf")
    export.add_argument("--no-modelfile", action="store_true", help="do not also write an Ollama Modelfile")
    imported = commands.add_parser("import-axolotl", help="print an axolotl config as a Ferry spec (YAML)")
    imported.add_argument("file", type=Path, help="the axolotl YAML config")
    return parser


def _import_axolotl(file: Path) -> int:
    """The Ferry spec on stdout (what is not converted as comments at its end), and that block on stderr.

    The config is read under the same YAML shape guard as every spec (an alias bomb is refused before it expands),
    and the spec printed is the serializer's text, read back and compared before it is printed."""
    from jobs.convert.axolotl import convert_axolotl

    try:
        converted = convert_axolotl(file.read_text())
        text = converted.to_yaml()
    except (ValueError, OSError) as error:
        print(error, file=sys.stderr)
        return 2
    print(text, end="")
    for warning in converted.warnings:
        print(warning, file=sys.stderr)
    return 0


def _merge(args: argparse.Namespace) -> int:
    from jobs.checkpoints.export import merge_lora_checkpoint  # peft and transformers: only this command needs them

    try:
        merged = merge_lora_checkpoint(
            args.checkpoint, args.output, archive=not args.no_archive, max_shard_size=args.max_shard_size
        )
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"merged into {merged}" + ("" if args.no_archive else f" (archive: {merged}.tar)"))
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.format == "lora":
        return _export_lora(args)
    from jobs.checkpoints.gguf_file import export_gguf  # gguf, transformers: only this command needs them

    try:
        written = export_gguf(args.checkpoint, args.output, args.quant, modelfile=not args.no_modelfile)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"wrote {written.path} ({written.architecture}, {written.quant}, {written.size_bytes / 1e6:.1f} MB)")
    if not args.no_modelfile:
        print(f"ollama create NAME -f {written.path.with_suffix('.Modelfile')}")
    return 0


def _export_lora(args: argparse.Namespace) -> int:
    from jobs.models.diffusion.lora_file import write_lora_file  # safetensors, diffusers: only this format

    try:
        written = write_lora_file(args.checkpoint, args.output)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"wrote {written} (ComfyUI: models/loras/; diffusers: pipe.load_lora_weights)")
    return 0


def _load(args: argparse.Namespace) -> tuple[JobSpec, str]:
    """The spec and its text, its paths confined to the roots given, else to the service's default roots
    (`jobs.paths`) beside the current directory: a shipped config runs here as it submits there."""
    text = args.file.read_text()
    return load_job_spec(text, roots=_roots(args)), text


def _roots(args: argparse.Namespace) -> PathRoots:
    return PathRoots(
        model_roots=args.model_root or [Path.cwd(), *default_model_roots()],
        data_roots=args.data_root or [Path.cwd(), *default_data_roots()],
    )


def machine_problems(spec: JobSpec, text: str) -> list[SpecProblem]:
    """The service's submit-time checks against this machine: a GPU for ``device: cuda``, enough host memory
    for the estimate (`jobs.fit.checks`, the messages the service gives)."""
    import psutil
    import torch

    has_gpu = torch.cuda.is_available()
    found = [device_problem(spec, has_gpu=has_gpu)]
    found.append(compile_problem(spec, has_gpu=has_gpu))
    if found[0] is None:  # the device problem: without the device the estimate means nothing
        estimate = estimate_memory(spec)
        found.append(
            host_limit_problem(
                host_memory_limit=estimate.host_memory_limit,
                engine_host_bytes=estimate.engine_host_bytes,
                disk_bytes=estimate.disk_bytes,
                fits=estimate.host_limit_fits,
                trainable_host_bytes=estimate.trainable_host_bytes,
                optimizer_host_bytes=estimate.optimizer_host_bytes,
                optimizer_swap_bytes=estimate.optimizer_swap_bytes,
            )
        )
        found.append(
            host_memory_problem(
                peak_device_bytes=estimate.peak_device_bytes,
                pinned_host_bytes=estimate.pinned_host_bytes,
                host_total_bytes=psutil.virtual_memory().total,
                on_host=spec.device == "cpu" or not has_gpu,
                optimizer_host_bytes=estimate.optimizer_host_bytes,
                ranks=estimate.ranks,
            )
        )
    return [SpecProblem(path, message, line_of(text, path)) for path, message in filter(None, found)]


def _length(spec: JobSpec) -> str:
    steps = spec.training.steps
    return f"{steps} steps" if steps is not None else f"{spec.training.epochs} epochs"


class _ProgressBar:
    """A report callback that drives a tqdm bar and prints lifecycle events."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def __call__(self, event: JobEvent) -> None:
        if isinstance(event, StartedEvent):
            self.bar = tqdm(total=event.total_steps, initial=event.resumed_from_step or 0, unit="step")
        elif isinstance(event, StepEvent) and self.bar is not None:
            self.bar.update(event.step - self.bar.n)
            self.bar.set_postfix(loss=f"{event.loss:.4f}", lr=f"{event.lr:.2e}")
        elif isinstance(event, CacheProgressEvent) and self.bar is not None:  # task: cache counts samples
            self.bar.update(event.step - self.bar.n)
            self.bar.set_postfix(samples_per_s=f"{event.samples_per_s:.2f}")
        elif isinstance(event, CheckpointEvent | LogEvent | FailedEvent | EvalEvent | SampleEvent):
            text = _describe(event)
            (self.bar.write if self.bar is not None else print)(f"[{event.type}] {text}")


def _describe(event: CheckpointEvent | LogEvent | FailedEvent | EvalEvent | SampleEvent) -> str:
    if isinstance(event, CheckpointEvent):
        return event.path
    if isinstance(event, EvalEvent):
        return f"step {event.step}: eval loss {event.eval_loss:.4f}"
    if isinstance(event, SampleEvent):
        return f"step {event.step}: {event.text if event.text is not None else event.artifact_path}"
    return event.message
