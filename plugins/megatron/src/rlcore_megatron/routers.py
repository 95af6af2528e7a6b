"""The router seam: every MoE router of the megatron model consults the ``router_hook`` chain.

Each megatron ``TopKRouter`` is a :class:`RouterSite` with an explicit identity — its layer id
in :class:`~rlcore.types.RouteLayout` terms (0-based decoder layer, ``num_hidden_layers + d``
for MTP depth ``d``) and its position on the routed-layer axis — rather than a position in a
global list of routers (verl's replay silently became a no-op when a second decoder was built,
and mixed dense/MoE stacks shifted the list). Inside the router, after the scores and before the
experts are used, :meth:`RouterSeam.decide` asks the dispatcher for the experts (rows with a
negative index keep the native choice), validates the answer (range, shape, no expert twice in
a row: a duplicate would collapse in megatron's routing map and unbalance the dispatcher),
records the experts used, and hands them back to the router, which recomputes the routing
weights from its own scores so the router keeps its gradient.

Two ways in, chosen by what the installed megatron-core offers (signatures, not versions):

* **native** (megatron-core ≥ 0.16): ``topk_routing_with_score_function`` takes a
  ``router_replay`` object and calls its ``get_replay_topk(scores, topk, ..., default_compute_topk)``.
  The engine turns ``moe_enable_routing_replay`` on and gives each router a
  :class:`RouterReplay` subclass bound to its site. Megatron's own class-level list of replay
  instances is not used (and is emptied of this model's routers).
* **intercept** (0.12.1 – 0.15): the routing function that ``megatron.core.transformer.moe.router``
  calls (``topk_softmax_with_capacity`` on 0.12/0.13, ``topk_routing_with_score_function`` on
  0.14/0.15; the router module imports it by name) is wrapped once per process, and replaced
  both in the router module and in ``moe_utils``, where it is defined. The wrapper
  is inert unless a seam is active for the router running (forward pre-hooks on each router say
  which one), calls the original, and, when the dispatcher chose other experts, rebuilds the
  routing weights and map from the logits the way the original does for the router's score
  function (softmax over the top-k or over all experts, sigmoid with normalisation, scaling).
  Token dropping (``moe_expert_capacity_factor``) cannot be replayed and is refused.

The fused router (``moe_router_fusion``, 0.14+, Transformer Engine) computes top-k in one kernel
that never calls the replay object, so replay would be skipped without a word: the engine builds
the model with fusion off and :meth:`RouterSeam.check_config` refuses a config that turns it on.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rlcore.engines.routing import apply_router_decision, forward_state_of_router_call, in_backward
from rlcore.errors import RLCoreError
from rlcore.types import MicroBatchContext, RouterCall

from rlcore_megatron.seam_listeners import notify_listeners


@dataclass
class RouterSite:
    router: Any
    layer: int
    routed_index: int
    is_mtp: bool
    num_experts: int
    topk: int


@dataclass
class RoutingState:
    """The seam's state during one forward (set by the engine, cleared after)."""

    dispatch: Callable[[RouterCall], Any] | None
    micro_batch: MicroBatchContext | None
    record: bool
    num_tokens: int  #: packed tokens this rank's routers see
    token_offset: int
    to_rows: Callable[[torch.Tensor], torch.Tensor]  #: packed [N, ...] -> router rows (fill -1 / 0)
    from_rows: Callable[[torch.Tensor], torch.Tensor]  #: router rows -> packed [N, ...]
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)
    #: routed index -> experts used in the forward when the dispatcher chose (for recomputation)
    used: dict[int, torch.Tensor] = field(default_factory=dict)
    recomputed: dict[int, int] = field(default_factory=dict)


def native_replay_available() -> bool:
    """megatron-core's routing function takes a ``router_replay`` object (≥ 0.16)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    return fn is not None and "router_replay" in inspect.signature(fn).parameters


class RouterSeam:
    """See module docstring. ``sites`` are in routed-layer order."""

    def __init__(self, sites: list[RouterSite], config: Any):
        self.sites = sites
        self.config = config
        self._state: RoutingState | None = None
        #: the last forward that consulted a dispatcher with grad on: routers re-run by activation
        #: recomputation in its backward replay what it used (``RouterCall.recompute``)
        self.last: RoutingState | None = None
        self.mode = "native" if native_replay_available() else "intercept"
        if self.mode == "native":
            _install_native(self)
        else:
            _install_interception(self)
        notify_listeners(self)  # other plugins adapt the routers here (rlcore_megatron.seams)

    @property
    def state(self) -> RoutingState | None:
        return self._state

    @state.setter
    def state(self, st: RoutingState | None) -> None:
        if (st is not None and (st.dispatch is not None or st.record) and self.mode == "intercept"
                and not interception_installed()):
            # something replaced the routing function after the seam wrapped it (MindSpeed's
            # repatch does): the routers would route without ever consulting the seam
            raise RLCoreError(
                "megatron-core's routing function in megatron.core.transformer.moe.router is no longer rlcore's "
                "router seam (it was replaced after the seam was installed, e.g. by MindSpeed's repatch): routes "
                "would be neither recorded nor replayed. Re-install it with "
                "rlcore_megatron.seams.reinstall_interception() after patching (rlcore-npu does this after "
                "MindSpeed's patch_features/repatch)")
        prev, self._state = self._state, st
        if st is not None:
            self.last = None
        elif prev is not None and prev.dispatch is not None and prev.used and torch.is_grad_enabled():
            self.last = prev

    # ------------------------------------------------------------------ checks -----------

    def check_config(self) -> None:
        if getattr(self.config, "moe_router_fusion", False):
            raise RLCoreError(
                "moe_router_fusion is on: the fused router never consults the router seam, so routes "
                "could be neither recorded nor replayed; the megatron engine needs it off"
            )

    # ------------------------------------------------------------------ the decision -----

    def decide(self, site: RouterSite, scores: torch.Tensor, native_idx: torch.Tensor) -> torch.Tensor:
        """The experts this router uses: ``native_idx`` ``[rows, topk]`` unless the dispatcher
        says otherwise (see module docstring). Records them when asked. A router re-run in the
        backward of a replayed forward (activation recomputation) asks again with
        ``recompute=True`` and must get the same experts."""
        st, recompute = forward_state_of_router_call(self.state, self.last, routed_index=site.routed_index,
                                                     layer=site.layer)
        if st is None:
            return native_idx
        idx = native_idx
        if st.dispatch is not None:
            call = RouterCall(
                layer=site.layer,
                routed_index=site.routed_index,
                is_mtp=site.is_mtp,
                num_experts=site.num_experts,
                topk=site.topk,
                token_offset=st.token_offset,
                num_tokens=st.num_tokens,
                micro_batch=st.micro_batch,
                scores=st.from_rows(scores.detach()),
                recompute=recompute,
            )
            decision = st.dispatch(call)
            if decision is not None:
                idx = apply_router_decision(decision, native_idx, layer=site.layer, num_experts=site.num_experts,
                                            topk=site.topk, num_tokens=st.num_tokens, to_rows=st.to_rows)
            if recompute:
                before = st.used.get(site.routed_index)
                if before is None or not torch.equal(idx, before):
                    raise RLCoreError(
                        f"router of layer {site.layer} got other experts under activation recomputation than in "
                        f"the forward: the gradient would not match the forward")
                return idx
            if decision is not None:
                st.used[site.routed_index] = idx.detach()
        if st.record:
            st.recorded[site.routed_index] = idx.detach()
        return idx

    def collect(self, num_packed: int) -> torch.Tensor:
        """Recorded routes ``[num_packed, routed_layers, topk]`` int16, -1 where a router did not
        run (MTP layers when MTP was not requested)."""
        st = self.state
        assert st is not None
        topk = self.sites[0].topk if self.sites else 0
        out = torch.full((num_packed, len(self.sites), topk), -1, dtype=torch.int16)
        for site in self.sites:
            rec = st.recorded.get(site.routed_index)
            if rec is not None:
                rows = st.from_rows(rec).to(torch.int16).cpu()
                out[st.token_offset: st.token_offset + rows.shape[0], site.routed_index] = rows
        return out


# ------------------------------------------------------------------------------------------
# native: megatron-core's RouterReplay hook point (≥ 0.16)
# ------------------------------------------------------------------------------------------


def _install_native(seam: RouterSeam) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class SiteRouterReplay(RouterReplay):
        """A ``RouterReplay`` bound to one :class:`RouterSite` of one :class:`RouterSeam`."""

        def __init__(self, seam_: RouterSeam, site: RouterSite):
            super().__init__()
            self.seam = seam_
            self.site = site

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            values, native_idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            idx = self.seam.decide(self.site, scores, native_idx)
            if idx is native_idx:
                return values, native_idx
            return scores.gather(1, idx), idx

    registry = RouterReplay.global_router_replay_instances
    for site in seam.sites:
        if not hasattr(site.router, "router_replay"):
            raise RLCoreError(f"megatron router of layer {site.layer} has no router_replay attribute")
        old = site.router.router_replay
        replay = SiteRouterReplay(seam, site)
        site.router.router_replay = replay
        for inst in (old, replay):
            # megatron's class-level list keeps every instance alive and positional; rlcore
            # addresses routers by site, so none of this model's stays there
            while inst is not None and any(r is inst for r in registry):
                registry.remove(inst)


# ------------------------------------------------------------------------------------------
# intercept: wrap the routing function megatron's router module calls (0.12.1 – 0.15)
# ------------------------------------------------------------------------------------------

_CURRENT = threading.local()
_ROUTING_FUNCTIONS = (("topk_routing_with_score_function", 2), ("topk_softmax_with_capacity", 3))
_WRAPPED_MARK = "_rlcore_router_seam"


def _active() -> tuple[RouterSeam, RouterSite] | None:
    return getattr(_CURRENT, "site", None)


def _routing_function() -> tuple[Any, str, int]:
    import megatron.core.transformer.moe.router as router_mod

    found = [(name, n) for name, n in _ROUTING_FUNCTIONS if getattr(router_mod, name, None) is not None]
    if not found:
        raise RLCoreError(
            "cannot find megatron-core's routing function in megatron.core.transformer.moe.router "
            f"(looked for {', '.join(n for n, _ in _ROUTING_FUNCTIONS)}): this megatron-core is not supported"
        )
    name, returns = found[0]
    return router_mod, name, returns


def interception_installed() -> bool:
    """The routing function megatron's router module calls is the seam's wrapper."""
    router_mod, name, _ = _routing_function()
    return bool(getattr(getattr(router_mod, name), _WRAPPED_MARK, False))


def install_interception() -> Callable:
    """Wrap the routing function the router module calls now (megatron-core's, or whatever a
    patcher such as MindSpeed put there) and put the wrapper in every loaded module that holds
    that function: the router module, ``moe_utils`` where it is defined, and any module that
    imported it by name (a patched ``routing()`` looks it up in its own module). Idempotent;
    returns the wrapper."""
    import sys

    router_mod, name, returns = _routing_function()
    fn = getattr(router_mod, name)
    if getattr(fn, _WRAPPED_MARK, False):
        return fn
    wrapped = _wrap_routing(fn, returns)
    for module in list(sys.modules.values()):
        try:
            holds = module is not None and module.__dict__.get(name) is fn
        except AttributeError:  # an odd entry in sys.modules without a namespace
            continue
        if holds:
            setattr(module, name, wrapped)
    return wrapped


def _install_interception(seam: RouterSeam) -> None:
    install_interception()
    for site in seam.sites:
        site.router.register_forward_pre_hook(_enter(seam, site))
        site.router.register_forward_hook(_leave)


def _enter(seam: RouterSeam, site: RouterSite):
    def hook(module, args):
        live = seam.state is not None or (seam.last is not None and in_backward())
        _CURRENT.site = (seam, site) if live else None

    return hook


def _leave(module, args, output):
    _CURRENT.site = None


def _wrap_routing(fn: Callable, returns: int) -> Callable:
    sig = inspect.signature(fn)

    def routing_with_seam(*args, **kwargs):
        if getattr(_CURRENT, "inside", False):
            # a wrapper of ours inside another routing function that a patcher put around an
            # earlier one (MindSpeed's patches replace whatever is in place): the outer one decides
            return fn(*args, **kwargs)
        _CURRENT.inside = True
        try:
            out = fn(*args, **kwargs)
        finally:
            _CURRENT.inside = False
        active = _active()
        if active is None:
            return out
        seam, site = active
        a = sig.bind(*args, **kwargs)
        a.apply_defaults()
        arg = a.arguments
        if arg.get("capacity_factor") is not None:
            raise RLCoreError(
                "MoE token dropping (moe_expert_capacity_factor) cannot be combined with rlcore's "
                "router seam: dropped tokens make recorded routes unreplayable"
            )
        logits, topk = arg["logits"], int(arg["topk"])
        probs, routing_map = out[0], out[1]
        native_idx = probs.masked_fill(~routing_map.bool(), float("-inf")).topk(topk, dim=-1).indices
        idx = seam.decide(site, logits, native_idx)
        if idx is native_idx:
            return out
        new_probs, new_map = _routing_from_indices(logits, idx, arg)
        if returns == 3:
            return new_probs, new_map, new_map.sum(dim=0)
        return new_probs, new_map

    setattr(routing_with_seam, _WRAPPED_MARK, True)
    routing_with_seam.__wrapped__ = fn  # type: ignore[attr-defined]
    return routing_with_seam


def _routing_from_indices(logits: torch.Tensor, idx: torch.Tensor, arg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights and map megatron's routing function gives for experts ``idx``."""
    score_function = arg.get("score_function", "softmax")
    topk = idx.shape[1]
    if score_function == "softmax":
        if arg.get("use_pre_softmax", False):
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits).gather(1, idx)
        else:
            probs = torch.softmax(logits.gather(1, idx), dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits).gather(1, idx)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise RLCoreError(f"router score function {score_function!r} cannot be replayed by rlcore")
    scale = arg.get("scaling_factor")
    if scale:
        probs = probs * scale
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int).scatter(1, idx, 1).bool()
    return routing_probs, routing_map
