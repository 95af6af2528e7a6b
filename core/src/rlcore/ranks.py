"""Which trainer rank this process is, and what it may write.

One rank (the *writer*, global rank 0) owns the run's output directory: the run marker, the
metrics, the plot, the HF exports and the checkpoints. Every other rank only reads, and only after
a :meth:`Ranks.barrier` that follows the write. Data-parallel ranks hold identical weights and
optimizer states (the gradients are all-reduced before every step), so the writer's checkpoint is
the gathered checkpoint of all of them and every rank resumes from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ranks:
    """A world of one: every method is a no-op; the trainer's default."""

    rank: int = 0
    world: int = 1

    @property
    def writer(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        """Everyone waits here until everyone arrived (after a write, before the reads)."""

    def broadcast(self, obj: Any) -> Any:
        """The writer's ``obj`` on every rank (any picklable object)."""
        return obj


SINGLE = Ranks()


class TorchRanks(Ranks):
    """The default process group of torch.distributed (already initialised)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("TorchRanks needs torch.distributed.init_process_group() first")
        object.__setattr__(self, "rank", dist.get_rank())
        object.__setattr__(self, "world", dist.get_world_size())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj if self.writer else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def on_writer(ranks: Ranks, fn: Any) -> Any:
    """Run ``fn`` on the writer only and hand its result to every rank; an exception it raises is
    raised on every rank (nobody is left waiting in the next collective), then a barrier."""
    if not ranks.distributed:
        return fn()
    outcome: tuple[bool, Any] = (True, None)
    if ranks.writer:
        try:
            outcome = (True, fn())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            outcome = (False, exc)
    ok, value = ranks.broadcast(outcome)
    if not ok:
        raise value
    return value
