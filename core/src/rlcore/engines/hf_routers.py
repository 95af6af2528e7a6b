"""Forward hooks on the MoE routers of a transformers model, shared by the ``hf`` training engine
and the ``local`` rollout backend.

transformers' ``*TopKRouter`` modules get a forward hook (PyTorch's public API, no
monkeypatching). During a :meth:`RouterSeam.forward_pass` the hook asks the ``router_hook``
chain which experts to use (when given a dispatch) and records the experts every router chose
(when asked to); outside one it does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.engines.routing import apply_router_decision, forward_state_of_router_call
from rlcore.errors import BatchShapeError
from rlcore.types import MicroBatchContext, RouteLayout, RouterCall, RouterDecision


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def find_routers(model: Any) -> list[tuple[int, Any]]:
    """``(layer_index, router_module)`` for every MoE router, ascending by layer. Two routers
    claiming one layer (a decoder built twice, an orphaned copy) are an error naming both."""
    out = []
    names: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=True):
        if type(mod).__name__.endswith("TopKRouter") and hasattr(mod, "top_k") and hasattr(mod, "num_experts"):
            parts = name.split(".")
            if "layers" not in parts:
                raise BatchShapeError(f"cannot tell the layer of MoE router {name!r}")
            layer = int(parts[parts.index("layers") + 1])
            if layer in names:
                raise BatchShapeError(
                    f"two MoE routers claim layer {layer}: {names[layer]!r} and {name!r} (a decoder built twice, "
                    f"or an orphaned router left in the model); routes could go to the one that never runs"
                )
            names[layer] = name
            mod._rlcore_router_name = name
            out.append((layer, mod))
    return sorted(out, key=lambda x: x[0])


def route_layout_of(model: Any) -> RouteLayout | None:
    routers = find_routers(model)
    if not routers:
        return None
    topk = {int(m.top_k) for _, m in routers}
    experts = {int(m.num_experts) for _, m in routers}
    if len(topk) != 1 or len(experts) != 1:
        raise BatchShapeError(f"MoE layers disagree on top-k {topk} / experts {experts}")
    return RouteLayout(
        layers=tuple(i for i, _ in routers),
        topk=topk.pop(),
        num_experts=experts.pop(),
        num_hidden_layers=int(model.config.num_hidden_layers),
    )


def routing_weights(router: Any, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The weights a transformers top-k router gives the experts ``indices``: softmax over all
    experts in fp32, gathered, renormalised over the top-k when the router does so."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(1, indices)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


@dataclass
class _ForwardPass:
    """What the router hooks do during one forward pass (see :meth:`RouterSeam.forward_pass`)."""

    dispatch: Callable[[RouterCall], RouterDecision | None] | None
    micro_batch: MicroBatchContext | None
    record: bool
    num_tokens: int
    to_rows: Callable[[torch.Tensor], torch.Tensor]  # packed [T, ...] -> router rows [N, ...]
    from_rows: Callable[[torch.Tensor], torch.Tensor]  # router rows -> packed
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)
    #: routed index -> how often the router ran in this forward / in recomputation
    ran: dict[int, int] = field(default_factory=dict)
    recomputed: dict[int, int] = field(default_factory=dict)
    #: routed index -> the experts used in the forward (replayed routers only), for recompute
    used: dict[int, torch.Tensor] = field(default_factory=dict)


class RouterSeam:
    """Forward hooks on every MoE router of a transformers model (see module docstring).

    ``routers`` are ``(layer_index, router_module)`` ascending; ``layout`` their
    :class:`~rlcore.types.RouteLayout` (``None`` for a dense model).

    Every forward run under :meth:`forward_pass` must run every router exactly once (an
    orphaned router that never runs, or one that runs twice, is an error naming it). A router
    that runs again during backward (activation recomputation, e.g. transformers' gradient
    checkpointing) after a forward with a dispatcher asks the chain again with
    ``RouterCall.recompute=True`` and must get the experts of the forward."""

    def __init__(self, model: Any):
        self.routers = find_routers(model)
        self.layout = route_layout_of(model)
        self.state: _ForwardPass | None = None
        #: the last forward with a dispatcher, for routers recomputed in its backward
        self.last: _ForwardPass | None = None
        self._handles = [
            mod.register_forward_hook(self._hook_for(pos, layer)) for pos, (layer, mod) in enumerate(self.routers)
        ]

    @contextmanager
    def forward_pass(
        self,
        *,
        num_tokens: int,
        record: bool = False,
        dispatch: Callable[[RouterCall], RouterDecision | None] | None = None,
        micro_batch: MicroBatchContext | None = None,
        to_rows: Callable[[torch.Tensor], torch.Tensor] = _same,
        from_rows: Callable[[torch.Tensor], torch.Tensor] = _same,
    ) -> Iterator[None]:
        """Hooks active for the model forwards run inside the block.

        ``num_tokens`` is the length of the caller's token axis; ``to_rows``/``from_rows`` map
        per-token tensors between it and the rows the routers see (the identity when they are
        the same). ``dispatch`` is consulted in every router (``router_hook`` chain);
        ``record`` keeps the chosen experts for :meth:`collect`, which must be called inside
        the block. On leaving it, every router must have run exactly once.
        """
        self.last = None
        self.state = _ForwardPass(dispatch, micro_batch, record, num_tokens, to_rows, from_rows)
        ok = False
        try:
            yield
            ok = True
        finally:
            st, self.state = self.state, None
            if ok and (dispatch is not None or record):
                self._check_ran(st)
                if dispatch is not None and torch.is_grad_enabled():
                    self.last = st

    def _check_ran(self, st: _ForwardPass) -> None:
        for pos, (layer, mod) in enumerate(self.routers):
            n = st.ran.get(pos, 0)
            if n != 1:
                what = "never ran (an orphaned router outside the forward path?)" if n == 0 else f"ran {n} times"
                raise BatchShapeError(
                    f"MoE router of layer {layer} ({getattr(mod, '_rlcore_router_name', type(mod).__name__)}) {what} "
                    f"in one forward; every router must consume its routes exactly once"
                )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook_for(self, routed_index: int, layer: int):
        def hook(module, args, output):
            st, recompute = forward_state_of_router_call(self.state, self.last, routed_index=routed_index,
                                                         layer=layer)
            if st is None:
                return None
            logits, scores, indices = output
            if not recompute:
                st.ran[routed_index] = st.ran.get(routed_index, 0) + 1
            if st.dispatch is not None:
                call = RouterCall(
                    layer=layer,
                    routed_index=routed_index,
                    is_mtp=False,
                    num_experts=int(module.num_experts),
                    topk=int(module.top_k),
                    token_offset=0,
                    num_tokens=st.num_tokens,
                    micro_batch=st.micro_batch,
                    scores=st.from_rows(logits.detach()),
                    recompute=recompute,
                )
                decision = st.dispatch(call)
                if recompute:
                    before = st.used.get(routed_index)
                    if (decision is None) != (before is None):
                        raise BatchShapeError(
                            f"router_hook answered differently for layer {layer} under activation recomputation "
                            f"({'no replay' if decision is None else 'replay'}) than in the forward"
                        )
                if decision is not None:
                    indices = apply_router_decision(decision, indices, layer=layer, num_experts=call.num_experts,
                                                    topk=call.topk, num_tokens=st.num_tokens, to_rows=st.to_rows)
                    if recompute:
                        if not torch.equal(indices, st.used[routed_index]):
                            bad = int((indices != st.used[routed_index]).any(dim=-1).nonzero()[0, 0])
                            raise BatchShapeError(
                                f"router of layer {layer} got other experts under activation recomputation than "
                                f"in the forward (router row {bad}: {st.used[routed_index][bad].tolist()} then "
                                f"{indices[bad].tolist()}): the gradient would not match the forward"
                            )
                    else:
                        st.used[routed_index] = indices.detach()
                    scores = routing_weights(module, logits, indices)
                    output = (logits, scores, indices)
            if st.record and not recompute:
                st.recorded[routed_index] = indices.detach()
            return output

        return hook

    def collect(self) -> torch.Tensor | None:
        """Recorded routes as ``[N, routed_layers, topk]`` int16 in layout order."""
        st = self.state
        if st is None or not st.recorded:
            return None
        self._check_ran(st)
        return torch.stack([st.recorded[i] for i in range(len(self.routers))], dim=1).to(torch.int16)
