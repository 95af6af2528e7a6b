"""The optional critic capability of a training engine (``Cap.VALUE_MODEL``).

An engine that declares ``value_model`` implements ``make_value_model() -> ValueModel``: a model
of the policy's architecture with a scalar head, initialised from the policy's trunk, with its
own parameters (a separate critic, as verl's and OpenRLHF's PPO default). Core
(:mod:`rlcore.critic`) builds its optimizer, runs its passes and trains it; an algorithm whose
settings have a ``critic`` group (PPO) needs it, and ``rlcore check`` refuses an engine that does
not declare it. Torch-free at runtime.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch

    from rlcore.batch import PackedBatch


def value_head(hidden: int, seed: int, device: Any) -> torch.nn.Linear:
    """The critic's scalar head an engine puts on its trunk: an fp32 ``Linear(hidden, 1)`` with
    OpenRLHF's initialisation (normal, std ``1/(hidden+1)``; bias 0), drawn from its own generator
    (``seed``) so that the policy's random stream is untouched."""
    import torch

    head = torch.nn.Linear(hidden, 1, dtype=torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(int(seed))
        head.weight.copy_(torch.randn(1, hidden, generator=g) / (hidden + 1))
        head.bias.zero_()
    return head.to(device)


@runtime_checkable
class ValueModel(Protocol):
    """A critic on the training engine.

    ``values(batch)`` returns ``[T]`` float32 on the batch's token axis (label-aligned: the value
    at the position whose log-prob scores token ``t``), differentiable when grad is enabled;
    entries off the loss mask are ignored. The optimizer methods mirror the engine's.
    """

    def values(self, batch: PackedBatch) -> torch.Tensor: ...

    def parameters(self) -> Iterator[torch.Tensor]: ...

    def train(self, mode: bool = True) -> Any: ...

    def setup_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float) -> None: ...

    def zero_grad(self) -> None: ...

    def optimizer_step(self, grad_clip: float) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
