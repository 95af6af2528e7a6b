"""Data parallelism for trainer ranks (engines with ``Cap.DATA_PARALLEL``, such as ``hf``): every
rank holds the whole model (the rank strategy :class:`DataParallel`).

Per step: the writer rank asks the rollout (a fleet of replicas, or its own backend) for the
samples and broadcasts them, so every rank packs the same step batch and computes the same
advantages (group statistics need every sample of a group). Each forward pass then runs only this
rank's contiguous share of the sequences; the loss of every micro-batch is already normalised by
the *whole step's* divisor (:mod:`rlcore.algorithms.aggregation`), so the sum of the ranks'
gradients is exactly the gradient of one rank with the whole batch: gradients are all-reduced
with SUM (not averaged), then every rank takes the same optimizer step. The no-grad passes'
log-probs are all-reduced the same way, and every pass's metrics are combined over the ranks as
one pass over all their micro-batches (:class:`rlcore.pass_metrics.PassMetrics`). Only the
writer pushes weights to the rollout; the other ranks drain the export (collective exports stay
in step) and follow its version. A postprocess plugin's per-token batch updates (recorded routes) cover this rank's
sequences only, which is all it reads: every pass gives a rank the same share.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from rlcore.batch import PackedBatch
from rlcore.parallel.push_memory import NO_METER, PeakResident, PushMeter
from rlcore.parallel.strategy import RankStrategy
from rlcore.pass_metrics import PassMetrics
from rlcore.ranks import Ranks
from rlcore.stack import Stack
from rlcore.types import Prompt, Sample, SamplingSettings, SyncReport


def shard_bounds(num_seqs: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``num_seqs`` sequences (sizes differ by at most one)."""
    base, extra = divmod(num_seqs, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def broadcast_parameters(params: Iterable[torch.Tensor]) -> None:
    """Rank 0's values everywhere (the ranks start from identical weights, as DDP does)."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def all_reduce_gradients(params: list[torch.Tensor], group: Any = None) -> None:
    """Sum every gradient over the ranks of ``group`` (``None``: every rank), one flat buffer per
    dtype. A parameter without a gradient on some rank (its shard never used it) gets zeros there
    when another rank has one; a parameter no rank has a gradient for stays without one (the
    optimizer skips it, as on one rank)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return
    device = trainable[0].device
    has = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    grads = []
    for p, h in zip(trainable, has.tolist(), strict=True):
        if h and p.grad is None:
            p.grad = torch.zeros_like(p)
        if h:
            grads.append(p.grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same_dtype])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same_dtype:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


class SampleBroadcast:
    """The rollout backend of a data-parallel rank. On the writer it wraps the real backend (a
    fleet of replicas, or an in-process one) and broadcasts every ``generate``'s samples; on the
    other ranks it receives them and otherwise only follows the weight version."""

    def __init__(self, ranks: Ranks, inner: Any = None, capabilities: frozenset[str] = frozenset()):
        self.ranks = ranks
        self.inner = inner
        self._caps = frozenset(capabilities)
        self._version = -1

    def __getattr__(self, name: str) -> Any:  # the writer's backend, for everything else
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def capabilities(self) -> frozenset[str]:
        return self.inner.capabilities() if self.inner is not None else self._caps

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version if self.inner is not None else self._version

    def follow(self, version: int) -> None:
        self._version = version

    def start(self, model_dir: str, version: int = 0) -> None:
        if self.inner is not None:
            self.inner.start(model_dir, version)
        self._version = version

    def generate(self, prompts: list[Prompt], params: SamplingSettings) -> list[Sample]:
        samples = self.inner.generate(prompts, params) if self.inner is not None else None
        return self.ranks.broadcast(samples)

    def pause(self) -> None:
        if self.inner is not None:
            self.inner.pause()

    def resume(self) -> None:
        if self.inner is not None:
            self.inner.resume()

    def release_memory(self, tags: frozenset[str]) -> None:
        if self.inner is not None:
            self.inner.release_memory(tags)

    def resume_memory(self, tags: frozenset[str]) -> None:
        if self.inner is not None:
            self.inner.resume_memory(tags)

    def reset_prefix_cache(self) -> None:
        if self.inner is not None:
            self.inner.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()


class FollowerSync:
    """The weight sync of a rank that does not push: it drains the export (an engine whose export
    gathers shards needs every rank in it) and moves its backend to the pushed version."""

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], target: SampleBroadcast, version: int) -> SyncReport:
        t0 = time.perf_counter()
        for _ in weights:
            pass
        target.follow(version)
        return SyncReport(version, 0, 0, 0, time.perf_counter() - t0, verified=False, method="follower",
                          details={"level": "none"})

    def close(self) -> None:
        pass


def rank_stack(stack: Stack, ranks: Ranks, rollout: Any = None) -> Stack:
    """The stack of one trainer rank: the writer's rollout backend (``rollout``, a fleet of
    replicas, or the configured one built in its process) broadcasts its samples to every rank;
    the other ranks receive them, and drain the export instead of pushing (:class:`FollowerSync`)."""
    declared = frozenset(stack.rollout_backend.capabilities)
    build_backend = stack.rollout_backend.factory

    def backend_factory(ctx: Any) -> SampleBroadcast:
        if not ranks.writer:
            return SampleBroadcast(ranks, None, declared)
        return SampleBroadcast(ranks, rollout if rollout is not None else build_backend(ctx))

    sync = stack.weight_sync if ranks.writer else replace(stack.weight_sync, factory=lambda ctx: FollowerSync())
    return replace(stack, rollout_backend=replace(stack.rollout_backend, factory=backend_factory), weight_sync=sync)


class DistributedRanks(RankStrategy):
    """What the distributed rank strategies share (data and model parallel): the writer's rollout
    broadcasts its samples to every rank, the others drain the export (:func:`rank_stack`), and
    the writer's push is measured (:mod:`.push_memory`). ``rollout``: the writer's rollout backend
    (a fleet of replicas); ``None`` builds the configured one in the writer's process."""

    def __init__(self, ranks: Ranks, rollout: Any = None):
        super().__init__(ranks)
        self.rollout = rollout

    def prepare_stack(self, stack: Any) -> Any:
        return rank_stack(stack, self.ranks, self.rollout)

    def push_meter(self) -> PushMeter:
        return PeakResident() if self.ranks.writer else NO_METER


class DataParallel(DistributedRanks):
    """Data-parallel trainer ranks (torch.distributed is initialised; see the module docstring)."""

    def built(self, engine: Any, reference: Any) -> None:
        broadcast_parameters(engine.parameters())
        if reference is not None:
            broadcast_parameters(reference.parameters())

    def micro_batches(self, batch: PackedBatch, budget: int) -> list[PackedBatch]:
        start, stop = shard_bounds(batch.num_seqs, self.ranks.rank, self.ranks.world)
        return batch.select_seqs(start, stop).micro_batches(budget) if start < stop else []

    def reduce_logprobs(self, logprobs: torch.Tensor) -> None:
        dist.all_reduce(logprobs)  # each rank filled its own sequences' rows, zeros elsewhere

    def reduce_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        all_reduce_gradients(list(parameters))

    def reduce_metrics(self, metrics: PassMetrics) -> PassMetrics:
        parts: list[Any] = [None] * self.ranks.world
        dist.all_gather_object(parts, metrics)
        return PassMetrics.combine(parts)
