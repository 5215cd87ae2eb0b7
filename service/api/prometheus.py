"""The /metrics body: the store's and scheduler's figures through ``prometheus_client`` (exposition format,
label escaping and content type as Prometheus expects them)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from jobs.events import StepEvent
from service.queue.status import JobStatus
from service.queue.store import JobStore
from service.workers.scheduler import Scheduler

# (metric, field of the latest StepEvent, help)
_JOB_GAUGES = (
    ("ferry_job_step", "step", "Latest step of a running job."),
    ("ferry_job_loss", "loss", "Latest training loss of a running job."),
    ("ferry_job_samples_per_second", "samples_per_s", "Training throughput of a running job."),
    ("ferry_job_device_peak_bytes", "device_peak_bytes", "Peak device memory of a running job."),
    ("ferry_job_pinned_bytes", "pinned_bytes", "Pinned host memory held by a running job."),
)


class FerryCollector:
    """Reads the figures at scrape time: nothing is kept between scrapes, so nothing goes stale."""

    def __init__(self, store: JobStore, scheduler: Scheduler) -> None:
        self.store, self.scheduler = store, scheduler

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("ferry_jobs", "Jobs in the store by status.", labels=["status"])
        for status, count in self.store.count_by_status().items():
            jobs.add_metric([status.value], count)
        yield jobs
        busy = len(self.scheduler.running)
        workers = GaugeMetricFamily("ferry_workers", "Worker slots by state.", labels=["state"])
        workers.add_metric(["busy"], busy)
        workers.add_metric(["idle"], len(self.scheduler.slots) - busy)
        yield workers
        running = self.store.jobs_with_status(JobStatus.RUNNING)
        latest = {job.id: _latest_step(job.progress) for job in running}
        for metric, key, help_text in _JOB_GAUGES:
            gauge = GaugeMetricFamily(metric, help_text, labels=["job_id", "worker"])
            for job in running:
                value = getattr(latest[job.id], key, None)
                if isinstance(value, int | float):
                    gauge.add_metric([job.id, job.worker or ""], value)
            yield gauge
        eval_loss = GaugeMetricFamily(
            "ferry_job_eval_loss",
            "Latest eval loss of a running job (jobs with an eval section).",
            labels=["job_id", "worker"],
        )
        for job in running:
            evals = self.store.list_events(job.id, limit=100_000, types=["eval"])
            if evals:
                eval_loss.add_metric([job.id, job.worker or ""], evals[-1].data["eval_loss"])
        yield eval_loss


def render_metrics(store: JobStore, scheduler: Scheduler) -> bytes:
    """The Prometheus text exposition of the service's figures now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FerryCollector(store, scheduler))
    return generate_latest(registry)


def _latest_step(progress: dict | None) -> StepEvent | None:
    """The job's latest step event, typed (the store adds when it arrived, which the event does not declare)."""
    if not progress:
        return None
    return StepEvent.model_validate({k: v for k, v in progress.items() if k != "reported_at"})
