"""PPO's critic on the megatron engine (``Cap.VALUE_MODEL``, :class:`rlcore.types.value.ValueModel`).

A second :class:`~rlcore_megatron.engine.MegatronEngine` built with the policy's weights (as the
KL reference is: megatron modules hold process groups and do not deep-copy), under the same
parallel layout (TP/EP/DP/PP), and a ``Linear(H, 1)`` head in fp32 replicated on every rank that
holds the final hidden states, initialised as the hf engine's (normal, std ``1/(H+1)``, bias 0,
from a generator seeded by ``training.seed``, so every such rank holds the same head).

The trunk's final hidden states are full ``[T, H]`` on every tensor-parallel rank (no sequence
parallelism), so every rank computes the same values and the same head gradient, and the
gradient into the trunk is already the full one on each rank (the row-parallel layers' reduce is
an identity in backward). The gradient norm counts the trunk's shards once
(:meth:`MegatronEngine.grad_norm`) and the replicated head once.

**Pipeline stages.** The trunk runs its stages inside ``forward`` as the policy's does
(:mod:`.pipeline`); the head lives on the last stage only (its parameters, gradient, optimizer
state and checkpoint entry; ``None`` on the other stages). The values are computed there and
broadcast over the pipeline (:func:`.pipeline.from_last_stage`), so every rank returns the same
``[T]`` values: the trainer's GAE returns, value loss and critic metrics are the last stage's on
every rank (the writer is stage 0). A stage before the last returns its stand-in (zero, computed
from its zero hidden states) into that broadcast, so its value-loss backward runs its chunks'
backward, with the activations' gradients sent back stage by stage. The gradient norm sums each
stage's trunk once and adds the head's over the pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from rlcore.errors import MissingCapabilityError
from rlcore.types import value_head

from rlcore_megatron.pipeline import from_last_stage


class MegatronValueModel:
    def __init__(self, policy: Any, seed: int = 0):
        # the policy's own engine class (rlcore_megatron.engine imports this module: no import back)
        self.body = type(policy)(policy.source, policy.settings, str(policy.device),
                                   str(policy.dtype).replace("torch.", ""), _weights_from=policy)
        self.pipe = self.body.pipe
        # the final hidden states exist on the last pipeline stage only
        self.head = value_head(self.body.info.hidden_size, seed, policy.device) \
            if self.pipe is None or self.pipe.last else None
        self.optimizer: torch.optim.Optimizer | None = None

    def values(self, batch: Any) -> torch.Tensor:
        out = self.body.forward(batch)
        if out.sequence_parallel:
            raise MissingCapabilityError(
                "engine 'megatron': the critic (algorithm.name=ppo) does not run with sequence parallelism yet "
                "(its hidden states are split over the tensor-parallel ranks); set megatron.sequence_parallel=false")
        if self.head is None:  # a stage before the last: a stand-in that keeps its chunks in the backward
            return from_last_stage(out.hidden.float().sum(-1) * 0.0, self.pipe)
        values = self.head(out.hidden.float()).squeeze(-1)
        return values if self.pipe is None else from_last_stage(values, self.pipe)

    def parameters(self) -> Iterator[torch.Tensor]:
        yield from self.body.parameters()
        if self.head is not None:
            yield from self.head.parameters()

    def train(self, mode: bool = True) -> MegatronValueModel:
        self.body.train(mode)
        if self.head is not None:
            self.head.train(mode)
        return self

    def setup_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        self.optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=float(lr),
                                           betas=tuple(float(b) for b in betas), weight_decay=float(weight_decay))

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def grad_norm(self) -> float:
        head = torch.zeros((), dtype=torch.float64, device=self.body.device)
        if self.head is not None:
            for p in self.head.parameters():
                if p.grad is not None:
                    head += p.grad.detach().double().pow(2).sum()
        trunk = self.body.grad_norm()
        if self.pipe is not None:  # the head's on the last stage, counted once on every stage
            dist.all_reduce(head, group=self.pipe.group)
        return (trunk ** 2 + float(head)) ** 0.5

    def optimizer_step(self, grad_clip: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("setup_optimizer() was not called")
        self.body.divide_expert_grads()  # as the policy's step
        return self.body.clipped_step(self.optimizer, self.parameters(), self.grad_norm(), grad_clip)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part: the trunk (pipelined, a state per chunk of this stage), the head
        (``None`` before the last stage) and the optimizer over both."""
        trunk = self.body.model.state_dict() if self.pipe is None else [c.state_dict() for c in self.body.chunks]
        return {"trunk": trunk, "head": self.head.state_dict() if self.head is not None else None,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.pipe is None:
            self.body.model.load_state_dict(state["trunk"])
        else:
            for chunk, chunk_state in zip(self.body.chunks, state["trunk"], strict=True):
                chunk.load_state_dict(chunk_state)
        if self.head is not None:
            self.head.load_state_dict(state["head"])
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
