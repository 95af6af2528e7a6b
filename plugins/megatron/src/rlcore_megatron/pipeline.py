"""Pipeline parallelism for the megatron engine (``megatron.pipeline_parallel_size`` > 1,
``cluster.trainer.pp`` under Ray), run inside :meth:`MegatronEngine.forward` so the trainer's
per-micro-batch ``forward`` → head → loss → backward stays as it is.

**Stages.** The decoder's layers are cut into ``pp * vpp`` contiguous chunks (``vpp``:
``megatron.virtual_pipeline_stages``, interleaved stages); pipeline rank ``s`` holds chunks
``s, s + pp, s + 2 pp, ...``, each a megatron-core ``GPTModel`` of its own layers (the embedding
only in chunk 0, the final norm and the output layer only in the last chunk). megatron-core's
parallel state is initialised with pipeline size 1: its tensor-parallel groups are the ones it
always builds (ranks ordered tensor-parallel fastest, then data-parallel, then pipeline), and the
pipeline and data-parallel groups are built here (:func:`pipeline_groups`). megatron's own
pipeline schedules are not used: they run the loss inside the schedule, which rlcore's trainer
computes itself.

**One micro-batch.** Every rank of a pipeline calls ``forward`` on the same micro-batch. A chunk
after the first receives its input from the rank of the previous chunk (:class:`_Recv`), a chunk
before the last sends its output to the next one (:class:`_Send`); the last chunk's rank returns
the final hidden states, the head and the loss as always. The other ranks return zero hidden
states of the same shape, and :meth:`MegatronEngine.head` gives them a zero LM-head weight: the
trainer's head and loss run on them (a uniform distribution, finite) and are thrown away — the
rank strategy takes log-probs and metrics from the last stage
(:class:`rlcore.parallel.model_parallel.ModelParallel`), and the backward of :class:`_Send`
replaces the gradient of those zero hidden states by the gradient the next stage sends back.
So a rank's ``loss.backward()`` runs its chunks' backward, in the reverse order of the forward,
with the gradients exchanged by the same send/receive pairs (a token tensor chains a rank's
chunks in autograd, so that its backward visits them all). The stages run one after another
(no overlap: a correct pipeline, not a fast one).

**PPO's critic.** Its trunk is a second engine of the same layout and runs the same way; its
value head is on the last stage, whose values every rank receives (:func:`from_last_stage`), the
other stages passing a stand-in built from their zero hidden states, so each rank's value-loss
backward still runs its chunks (:mod:`.value`).

**Export.** Each stage exports its own tensors (tensor-parallel gathers inside the stage);
the first data-parallel replica's tensor-parallel rank 0 of every later stage sends them, name
and shape first, to global rank 0 (the writer), which yields them after its own: no rank but the
writer ever holds a tensor of another stage (:func:`gather_stages`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: groups built once per process (every rank must create every group, in the same order)
_GROUPS: dict[tuple[int, int, int], PipelineGroups] = {}


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's place in a ``tp x dp x pp`` layout (rank = tp_rank + tp * (dp_rank + dp * stage))."""

    tp: int
    dp: int
    pp: int
    stage: int
    dp_rank: int
    tp_rank: int
    ranks: tuple[int, ...]  # the global ranks of this pipeline, stage by stage
    group: Any  # this pipeline's process group
    dp_group: Any  # the ranks of this stage and tensor-parallel rank over the replicas (None: dp = 1)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int) -> int:
        return self.ranks[stage % self.pp]

    @property
    def sends_export(self) -> bool:
        """This rank sends its stage's exported tensors to the writer (see the module docstring)."""
        return self.stage > 0 and self.tp_rank == 0 and self.dp_rank == 0


def forget_pipeline_groups() -> None:
    """Drop this process's pipeline groups (at the engine's close: torch.distributed's
    ``destroy_process_group()`` shuts them down with the default group)."""
    _GROUPS.clear()


def pipeline_groups(tp: int, pp: int) -> PipelineGroups:
    """The pipeline and data-parallel groups of this rank (created on first use, on every rank)."""
    world = dist.get_world_size()
    dp = world // (tp * pp)
    key = (tp, dp, pp)
    if key not in _GROUPS:
        rank = dist.get_rank()
        tp_rank, rest = rank % tp, rank // tp
        dp_rank, stage = rest % dp, rest // dp

        def at(t: int, d: int, s: int) -> int:
            return t + tp * (d + dp * s)

        mine_pp = mine_dp = None
        for t in range(tp):
            for d in range(dp):
                ranks = [at(t, d, s) for s in range(pp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine_pp = (tuple(ranks), group)
        if dp > 1:
            for t in range(tp):
                for s in range(pp):
                    ranks = [at(t, d, s) for d in range(dp)]
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine_dp = group
        assert mine_pp is not None
        _GROUPS[key] = PipelineGroups(tp, dp, pp, stage, dp_rank, tp_rank, mine_pp[0], mine_pp[1], mine_dp)
    return _GROUPS[key]


def chunk_layers(num_layers: int, chunks: int) -> list[tuple[int, int]]:
    """``(first layer, layer count)`` of each of ``chunks`` contiguous chunks (sizes differ by at
    most one, the earlier chunks larger)."""
    base, extra = divmod(num_layers, chunks)
    out, start = [], 0
    for c in range(chunks):
        n = base + (1 if c < extra else 0)
        out.append((start, n))
        start += n
    return out


class _Send(torch.autograd.Function):
    """Forward: send ``x`` to rank ``dst``; return zeros of ``out_shape`` (a token, or the zero
    hidden states the trainer's head reads on a stage before the last). Backward: whatever
    gradient they got is replaced by the one ``dst`` sends back for ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dst: int, out_shape: tuple[int, ...]) -> torch.Tensor:
        dist.send(x.detach().contiguous(), dst)
        ctx.dst, ctx.shape, ctx.dtype, ctx.device = dst, x.shape, x.dtype, x.device
        return x.new_zeros(out_shape)

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        dist.recv(grad, ctx.dst)
        return grad, None, None


class _Recv(torch.autograd.Function):
    """Forward: receive the previous chunk's output from rank ``src`` (``token`` chains it after
    this rank's earlier chunks in autograd). Backward: send its gradient back to ``src``."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=token.device)
        dist.recv(x, src)
        ctx.src = src
        ctx.token_shape = token.shape
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        dist.send(grad.contiguous(), ctx.src)
        return torch.zeros(ctx.token_shape, dtype=grad.dtype, device=grad.device), None, None, None


def run_chunks(chunks: list[Any], groups: PipelineGroups, run_chunk: Any, activation_shape: tuple[int, ...],
               packed_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """This rank's chunks over one micro-batch (see the module docstring). ``run_chunk(chunk,
    last)`` runs one ``GPTModel`` chunk (its input set beforehand when it is not the first) and
    returns ``[s, b, h]`` hidden states (the final ones, packed, for the last chunk). Returns the
    final hidden states on the last chunk's rank, the zero stand-in elsewhere."""
    pp = groups.pp
    total = pp * len(chunks)
    token = torch.zeros(1, dtype=dtype, device=device, requires_grad=torch.is_grad_enabled())
    for v, chunk in enumerate(chunks):
        c = v * pp + groups.stage
        if c > 0:
            x = _Recv.apply(token, groups.rank_of(groups.stage - 1), activation_shape, dtype)
            chunk.set_input_tensor(x)
        last = c == total - 1
        y = run_chunk(chunk, last)
        if last:
            return y
        out_shape = packed_shape if v == len(chunks) - 1 else (1,)
        token = _Send.apply(y, groups.rank_of(groups.stage + 1), out_shape)
    return token


class _FromLastStage(torch.autograd.Function):
    """Forward: the last stage's ``x``, broadcast over the pipeline (every rank returns it).
    Backward: the last stage keeps its gradient (its ``x`` is the real one); the other stages'
    ``x`` is a stand-in, whose gradient is zero (their chunks get theirs through :class:`_Send`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: PipelineGroups) -> torch.Tensor:
        out = x.detach().clone().contiguous()
        dist.broadcast(out, src=groups.rank_of(groups.pp - 1), group=groups.group)
        ctx.last = groups.last
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad if ctx.last else torch.zeros_like(grad)), None


def from_last_stage(x: torch.Tensor, groups: PipelineGroups) -> torch.Tensor:
    """The last stage's ``x`` on every rank of the pipeline (every rank passes a tensor of the
    same shape and dtype; before the last stage, one computed from the zero hidden states
    :func:`run_chunks` returned, so that the rank's loss backward still reaches its chunks).
    PPO's critic hands its values back this way: the value head runs on the last stage only,
    and every rank's value loss, metrics and GAE returns are the last stage's."""
    return _FromLastStage.apply(x, groups)


def gather_stages(stream: Iterator[tuple[str, torch.Tensor]], groups: PipelineGroups,
                  device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's HF-named tensors at the writer (global rank 0), after its own; other ranks
    yield their own stage's (every rank must consume the stream: the tensor-parallel gathers
    and the sends are collective)."""
    if dist.get_rank() != 0:
        for name, tensor in stream:
            if groups.sends_export:
                dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=0)
                dist.send(tensor.contiguous(), 0)
            yield name, tensor
        if groups.sends_export:
            dist.send_object_list([None], dst=0)
        return
    yield from stream
    for stage in range(1, groups.pp):
        src = groups.rank_of(stage)
        while True:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=src)
            if box[0] is None:
                break
            name, shape, dtype = box[0]
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src)
            yield name, tensor
