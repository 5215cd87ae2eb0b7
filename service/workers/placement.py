"""Which queued job starts on which free slots: a job of ``distributed.world_size: N`` takes N GPUs of this
host at once, and neither a wide job nor the narrow ones behind it waits for ever.

The oldest queued job that fits the free slots starts, on the lowest-numbered of them. The oldest job that
does not fit becomes the *holder*: every slot that frees from then on is kept for it, so it starts once the
jobs running when it began to wait have ended (it is never overtaken for good). Younger jobs may still start
on the slots that were free and unkept when it began to wait, so one GPU does not idle behind a job that
cannot use it yet. On CPU slots a job of several ranks runs its ranks as processes of one slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import yaml

from service.queue.records import JobRecord
from service.workers.devices import Slot

log = logging.getLogger("ferry.placement")


def ranks_of(job: JobRecord) -> int:
    """The job's ``distributed.world_size`` (1 when absent; the spec was validated when it was queued)."""
    return ranks_in(job.spec_text)


def ranks_in(spec_text: str) -> int:
    """``distributed.world_size`` of a queued spec's text."""
    try:
        spec = yaml.safe_load(spec_text)
        size = int(((spec or {}).get("distributed") or {}).get("world_size", 1))
    except (yaml.YAMLError, AttributeError, TypeError, ValueError):
        return 1
    return max(1, size)


def gpus_needed(job: JobRecord, slots: list[Slot]) -> int:
    """Slots the job takes: one per rank on GPU slots, one in all on CPU slots."""
    return ranks_of(job) if any(slot.device is not None for slot in slots) else 1


@dataclass
class Placement:
    """Chooses the jobs to start each scheduler tick, and keeps the freed slots for the holder."""

    holder: str | None = None  # the oldest queued job that did not fit
    kept: set[str] = field(default_factory=set)  # slot ids freed since it began to wait

    def freed(self, slot_ids: list[str]) -> None:
        """Slots whose job ended: kept for the holder, if one waits."""
        if self.holder is not None:
            self.kept.update(slot_ids)

    def choose(
        self, queued: list[JobRecord], free: list[Slot], slots: list[Slot]
    ) -> list[tuple[JobRecord, list[Slot]]]:
        """(job, its slots) to start now, oldest job first. ``queued`` oldest first; ``free``: the idle slots."""
        if self.holder is not None and self.holder not in {job.id for job in queued}:
            self.holder, self.kept = None, set()  # it started, or was cancelled or paused while waiting
        starts = []
        free = list(free)
        for job in queued:
            if not free:
                break
            need = gpus_needed(job, slots)
            usable = (
                free if job.id == self.holder or self.holder is None else [s for s in free if s.id not in self.kept]
            )
            if len(usable) >= need:
                taken = usable[:need]
                starts.append((job, taken))
                free = [slot for slot in free if slot not in taken]
                if job.id == self.holder:
                    self.holder, self.kept = None, set()
            elif self.holder is None:
                self.holder = job.id
                log.info("%s waits for %d slots (%d free); slots that free are kept for it", job.id, need, len(free))
        return starts
