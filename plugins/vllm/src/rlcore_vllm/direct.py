"""Direct copies into vLLM's parameters (``vllm.transport: mapped``), learned from a loader push.

vLLM's layerwise reload (the loader path of :mod:`rlcore_vllm.worker_ext`) re-creates every layer,
runs its loaders, processes it and copies the result back into the layer's original tensors: about
a quarter of a second for a 1 GB model on an H200, against ~1 ms for copying the same bytes. Where
processing leaves the loaded bytes as they are (unquantized weights on a GPU: vLLM's
``process_weights_after_loading`` is a no-op there), every HF tensor ends up as one slice of one
parameter: ``q_proj`` as rows of ``qkv_proj``, an expert's ``w1`` as half of ``w13_weight[e]``.
This module learns those slices from one push through the loaders and hands them to
:class:`rlcore_ray.transport.MappedReceiver` as its direct destinations, which copies straight out
of the trainer's parameters (lent by CUDA IPC, no bucket) into them.

**When a plan is taken** (:func:`learn_plan`, at the finish of a verified loader push that asked for
it), every condition holds, else the plan is refused with the reason and pushes keep the loaders:

* every received tensor was located by the read-back (:mod:`rlcore_vllm.readback`) as a slice of a
  parameter, and the same slice of the parameter the layer holds *after* processing (its original
  kernel tensor) is contiguous and holds exactly the received bytes (checksums): processing moved
  or changed nothing;
* processing built no derived state: no attribute of any module of the model was added or
  replaced during the push (on CPU, for one, vLLM sets ``layer.cpu_linear`` to a GEMM over a
  prepacked copy of the weight and empties the parameter: refused, naming it);
* no speculative draft (its weights go through their own reload) and tensor parallel size 1 (the
  read-back locates full tensors only).

**What a mapped push checks**: names and shapes against the checkpoint the engine was started from
and every one of its tensors present (``coverage``, when the layout arrives), the checksums of what
landed in the parameters against the trainer's of what it lent (``exact``, summed in the copy), and
that the destinations did not move (re-planned when an engine that slept has them elsewhere). The
model refuses to compute from the start of the push until its commit, as on the loader path.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore_vllm.readback import Located

#: attributes layerwise reload itself sets or clears on a model or its layers during a push
_RELOAD_BOOKKEEPING = frozenset({"_already_called_process_weights_after_loading", "_original_do_torchao_reload",
                                 "_do_torchao_reload"})
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {"_rlcore"}


_PLAIN = (int, float, str, bool, type(None))


def attribute_identities(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """``{module name: {attribute: value}}`` of every module's own attributes (not its parameters,
    buffers, submodules or torch's bookkeeping): what processing could add or replace. The values
    are held, so a replaced object is told apart by identity (an id could be reused)."""
    return {name: attribute_identities_of(module) for name, module in model.named_modules()}


def attribute_identities_of(module: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS and k not in _RELOAD_BOOKKEEPING}


def _same_content(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and bool(torch.equal(a, b)))
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return a == b
    return a is b


def rebuilt_attributes(before: dict[str, dict[str, Any]], model: torch.nn.Module,
                       weight_modules: set[int]) -> list[str]:
    """``module.attribute`` names added or replaced since ``before`` (what a direct copy would
    leave stale). A module that received weights in the push, or holds one that did (MLA's
    attention derives its absorbed matrices from its ``kv_b_proj``), must keep every attribute
    object as it was (plain values compare by value); any other module is processed again by
    vLLM without new weights (attention re-derives ``_k_scale_cpu`` from its scales) and only
    a change of content counts. ``weight_modules``: ``id()`` of the modules that received weights
    or were refreshed for a shared one."""
    missing = object()
    changed = []
    for name, module in model.named_modules():
        holds_weights = any(id(m) in weight_modules for m in module.modules())
        old = before.get(name, {})
        for k, v in attribute_identities_of(module).items():
            was = old.get(k, missing)
            if holds_weights:
                same = (was == v) if isinstance(v, _PLAIN) and isinstance(was, _PLAIN) else (was is v)
            else:
                same = was is not missing and _same_content(was, v)
            if not same:
                changed.append(f"{name}.{k}" if name else k)
    return sorted(changed)


class DirectPlan:
    """``{HF name: the parameter slice it is copied into}``, resolved again from the layers' live
    parameters whenever one of them is no longer the storage it was (an engine that released its
    weights and allocated them anew), so a destination never points at memory the model let go."""

    def __init__(self, located: dict[str, Located], regions: dict[str, torch.Tensor]):
        self.located = located
        self.regions = regions
        self._bases = self._base_pointers()

    def _base_pointers(self) -> list[int]:
        return [getattr(loc.layer, loc.param_name).data_ptr() for loc in self.located.values()]

    def __len__(self) -> int:
        return len(self.regions)

    def destinations(self) -> dict[str, torch.Tensor]:
        bases = self._base_pointers()
        if bases != self._bases:
            regions, why = resolve_regions(self.located)
            if regions is None:
                raise RuntimeError(f"rlcore: after the engine re-allocated its weights a direct copy's destination is "
                                   f"gone: {why}")
            self.regions, self._bases = regions, bases
        return self.regions


def resolve_regions(located: dict[str, Located]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """Each tensor's contiguous slice of its layer's parameter as the layer holds it now, or
    ``(None, why)`` for the first that has none."""
    regions: dict[str, torch.Tensor] = {}
    for name, loc in located.items():
        region, why = loc.region()
        if region is None:
            return None, f"{name}: after vLLM's processing {why}"
        if not region.is_contiguous():
            return None, f"{name}: its slice of the parameter is not contiguous (stride {tuple(region.stride())})"
        regions[name] = region
    return regions, ""


def weight_module_ids(located: dict[str, Located], model: torch.nn.Module, refreshed: list[str]) -> set[int]:
    """``id()`` of the modules whose loaders ran in the push, and of those refreshed for a shared parameter."""
    ids = {id(loc.layer) for loc in located.values()}
    for name in refreshed:
        ids.add(id(model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model))
    return ids


def learn_plan(located: dict[str, Located], received_sums: dict[str, int], rebuilt: list[str],
               refusal: str | None = None) -> tuple[DirectPlan | None, str | None]:
    """``(plan, None)``, or ``(None, why not)`` (see the module docstring). ``received_sums``: the checksums of what the worker received,
    already equal to the trainer's (the loader push checks them)."""
    from rlcore.sync import ChecksumSlots

    if refusal:
        return None, refusal
    if rebuilt:
        return None, (f"vLLM's processing rebuilt {len(rebuilt)} attribute(s) from the weights (e.g. "
                      f"{rebuilt[:3]}): a direct copy into the parameters would leave them stale")
    missing = sorted(set(received_sums) - set(located))
    if missing:
        return None, (f"{len(missing)} received tensor(s) were not located in a parameter by the read-back (e.g. "
                      f"{missing[:3]})")
    located = {n: located[n] for n in received_sums}
    plan, why = resolve_regions(located)
    if plan is None:
        return None, why
    names = list(plan)
    held: dict[str, int] = {}
    if names:  # one launch and one read for all
        sums = ChecksumSlots(plan[names[0]].device, capacity=len(names))
        held = dict(zip(names, sums.values(sums.checksum([plan[n] for n in names])), strict=True))
    changed = [n for n in names if held[n] != received_sums[n]]
    if changed:
        return None, (f"after vLLM's processing {len(changed)} parameter slice(s) hold other bytes than were loaded "
                      f"(e.g. {changed[:3]}): processing transforms the weights")
    return DirectPlan(located, plan), None


class DirectTarget:
    """The worker as :class:`~rlcore_ray.transport.MappedReceiver`'s target: its direct
    destinations are the learned plan; ``begin``/``commit``/``abort`` drive the compute guard
    (:meth:`~rlcore_vllm.worker_ext.RLCoreWorkerExtension._rlcore_guard`)."""

    def __init__(self, worker: Any):
        self.worker = worker

    @property
    def state(self) -> dict[str, Any]:
        return self.worker._rlcore_state()

    def weight_manifest(self) -> Any:
        return self.state["direct_manifest"]

    def direct_destinations(self) -> dict[str, torch.Tensor]:
        return self.state["direct_plan"].destinations()

    def begin_update(self, version: int) -> None:
        state = self.state
        state["version"], state["finished"] = int(version), None
        self.worker._rlcore_guard(True, "is in progress (direct copies)")

    def receive_bucket(self, bucket: Any) -> None:
        raise RuntimeError(f"rlcore: {bucket.names[:3]} have no direct destination in this engine (the plan learned "
                           f"at version {self.state.get('direct_learned_at')} does not name them): push through "
                           f"vLLM's loaders")

    def commit_update(self, version: int) -> None:
        state = self.state
        state["finished"] = state["version"] = int(version)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.worker.model_runner, reset, None)
            if callable(fn):
                fn()
        self.worker._rlcore_guard(False)

    def abort_update(self) -> None:
        self.state["finished"] = None
        self.worker._rlcore_guard(True, "is partial or failed: a direct-copy push stopped after its copies began")
