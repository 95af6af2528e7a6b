"""PPO's critic on the megatron engine (``Cap.VALUE_MODEL``, :class:`rlcore.types.value.ValueModel`).

A second :class:`~rlcore_megatron.engine.MegatronEngine` built with the policy's weights (as the
KL reference is: megatron modules hold process groups and do not deep-copy), under the same
parallel layout (TP/EP), and a ``Linear(H, 1)`` head in fp32 replicated on every rank, initialised
as the hf engine's (normal, std ``1/(H+1)``, bias 0, from a generator seeded by
``training.seed``, so every rank holds the same head).

The trunk's final hidden states are full ``[T, H]`` on every tensor-parallel rank (no sequence
parallelism), so every rank computes the same values and the same head gradient, and the
gradient into the trunk is already the full one on each rank (the row-parallel layers' reduce is
an identity in backward). The gradient norm counts the trunk's shards once
(:meth:`MegatronEngine.grad_norm`) and the replicated head once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from rlcore.errors import MissingCapabilityError
from rlcore.types import value_head


class MegatronValueModel:
    def __init__(self, policy: Any, seed: int = 0):
        # the policy's own engine class (rlcore_megatron.engine imports this module: no import back)
        self.body = type(policy)(policy.source, policy.settings, str(policy.device),
                                   str(policy.dtype).replace("torch.", ""), _weights_from=policy)
        self.head = value_head(self.body.info.hidden_size, seed, policy.device)
        self.optimizer: torch.optim.Optimizer | None = None

    def values(self, batch: Any) -> torch.Tensor:
        out = self.body.forward(batch)
        if out.sequence_parallel:
            raise MissingCapabilityError(
                "engine 'megatron': the critic (algorithm.name=ppo) does not run with sequence parallelism yet "
                "(its hidden states are split over the tensor-parallel ranks); set megatron.sequence_parallel=false")
        return self.head(out.hidden.float()).squeeze(-1)

    def parameters(self) -> Iterator[torch.Tensor]:
        yield from self.body.parameters()
        yield from self.head.parameters()

    def train(self, mode: bool = True) -> MegatronValueModel:
        self.body.train(mode)
        self.head.train(mode)
        return self

    def setup_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        self.optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=float(lr),
                                           betas=tuple(float(b) for b in betas), weight_decay=float(weight_decay))

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def grad_norm(self) -> float:
        head = sum(float(p.grad.detach().double().pow(2).sum()) for p in self.head.parameters() if p.grad is not None)
        return (self.body.grad_norm() ** 2 + head) ** 0.5

    def optimizer_step(self, grad_clip: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("setup_optimizer() was not called")
        self.body.divide_expert_grads()  # as the policy's step
        return self.body.clipped_step(self.optimizer, self.parameters(), self.grad_norm(), grad_clip)

    def state_dict(self) -> dict[str, Any]:
        return {"trunk": self.body.model.state_dict(), "head": self.head.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.body.model.load_state_dict(state["trunk"])
        self.head.load_state_dict(state["head"])
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
