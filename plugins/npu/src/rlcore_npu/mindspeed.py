"""MindSpeed (Ascend's megatron-core adaptor) and megatron-core 0.12.1, made to work with rlcore's
router seam, so that routing replay neither breaks nor silently does nothing there.

What MindSpeed does that matters here (read from Ascend/MindSpeed 2.3.0_core_r0.12.1,
``mindspeed/patch_utils.py``, ``megatron_adaptor.py``, ``features_manager/``,
``core/megatron_basic/arguments_basic.py``):

* ``MindSpeedPatchesManager.register_patch(name, fn)`` then ``apply_patches()``: a patch replaces
  the function at ``name`` *and in every module of sys.modules that holds the function found
  there*; functions named ``*wrapper`` / ``*decorator`` stack on it. ``remove_patches()`` puts
  the original back only where the module still holds MindSpeed's function.
* ``megatron_adaptor.patch_features()`` applies every feature's patches when the adaptor is
  imported; ``repatch(args)`` removes all of them and applies them again. Both end in
  ``MindSpeedPatchesManager.apply_patches()``.
* It patches the functions replay needs: ``moe_utils.topk_softmax_with_capacity`` (``--fix-router``)
  and ``router.TopKRouter.routing`` (``--moe-tp-extend-ep``: a routing() that calls the top-k
  function it imported into its own module).
* ``TransformerConfig.__init__`` is wrapped: keyword arguments (merged over MindSpeed's own
  argument namespace) are split by ``inspect.signature`` of the class; unknown keys make it
  rebuild the instance's class with ``dataclasses.make_dataclass`` (new ``init=False`` fields)
  and set them, except a key the class already has as an attribute, whose value is dropped.

What this module does about it:

* :func:`setup_mindspeed` imports the adaptor (so MindSpeed patches first) and
  :func:`enable_mindspeed_compat` makes ``MindSpeedPatchesManager.apply_patches`` re-install the
  seam's interception after every application (patch_features, repatch): the seam wraps whatever
  top-k function MindSpeed put in place, in every module holding it
  (:func:`rlcore_megatron.seams.reinstall_interception`). Should anything still replace it, the
  seam refuses the next replaying forward instead of routing natively.
* On every seam (:func:`adapt_seam`, a listener of :func:`rlcore_megatron.seams.add_listener`):
  methods 0.12.1's routers lack are bound per instance when the class lacks them
  (:func:`bind_missing_router_methods`; detected by attribute, never by a
  version string), and a config that would bypass or break replay is refused naming the field
  (:func:`check_replayable_config`).
* :func:`check_config_kept` checks that the values rlcore asked for survived MindSpeed's
  rebuilding of the config; :func:`transformer_layer_offset` calls megatron's layer-offset
  function with or without ``vp_stage`` according to its signature.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Mapping
from typing import Any

from rlcore.errors import ConfigError, RLCoreError

MODES = ("auto", "required", "off")
MINDSPEED_INSTALL = ("pip install git+https://gitcode.com/Ascend/MindSpeed.git@2.3.0_core_r0.12.1 "
                     "(the branch matching your megatron-core)")
ADAPTOR = "mindspeed.megatron_adaptor"
PATCH_UTILS = "mindspeed.patch_utils"
_AFTER_APPLY_MARK = "_rlcore_reinstalls_router_seam"


# ------------------------------------------------------------------ setup ------------------


def mindspeed_active() -> bool:
    """MindSpeed's adaptor has been imported (its patches are applied)."""
    return ADAPTOR in sys.modules


def setup_mindspeed(mode: str = "auto") -> bool:
    """``npu.mindspeed``: ``auto`` uses MindSpeed when it is installed, ``required`` fails
    without it, ``off`` leaves it alone. Returns whether MindSpeed compatibility is on."""
    if mode not in MODES:
        raise ConfigError(f"npu.mindspeed must be one of {', '.join(MODES)}, got {mode!r}", key="npu.mindspeed")
    if mode == "off":
        return False
    if not mindspeed_active():
        if importlib.util.find_spec("mindspeed") is None:
            if mode == "required":
                raise ConfigError(f"npu.mindspeed is 'required' but MindSpeed is not installed: {MINDSPEED_INSTALL}",
                                  key="npu.mindspeed")
            return False
        importlib.import_module(ADAPTOR)  # runs patch_features(): MindSpeed patches before rlcore does
    enable_mindspeed_compat()
    return True


def enable_mindspeed_compat() -> None:
    """Re-install the router seam after every MindSpeed patch application, and adapt every seam
    built from now on. Idempotent."""
    from rlcore_megatron import seams

    manager = importlib.import_module(PATCH_UTILS).MindSpeedPatchesManager
    apply = manager.__dict__["apply_patches"]
    original = apply.__func__ if isinstance(apply, staticmethod) else apply
    if not getattr(original, _AFTER_APPLY_MARK, False):

        def apply_patches_then_router_seam():
            original()
            seams.reinstall_interception()

        setattr(apply_patches_then_router_seam, _AFTER_APPLY_MARK, True)
        apply_patches_then_router_seam.__wrapped__ = original  # type: ignore[attr-defined]
        manager.apply_patches = staticmethod(apply_patches_then_router_seam)
    seams.add_listener(adapt_seam)
    seams.reinstall_interception()  # the top-k function now in place: MindSpeed's, after its patches


def adapt_seam(seam: Any) -> None:
    """Called with every router seam rlcore-megatron installs (:func:`rlcore_megatron.seams.add_listener`):
    bind missing router methods and refuse a config replay cannot work with."""
    check_replayable_config(seam.config)
    for site in seam.sites:
        bind_missing_router_methods(site.router)


# ------------------------------------------------------------------ routers ----------------


def _aux_loss_coeff(router: Any, aux_loss_type: str) -> float:
    """The coefficient of ``aux_loss_type`` on this router: ``routing_type`` and
    ``config.moe_aux_loss_coeff`` are a str and a float on 0.12.1, parallel lists later."""
    routing, coeff = router.routing_type, router.config.moe_aux_loss_coeff
    if isinstance(routing, (list, tuple)):
        if aux_loss_type not in routing:
            return 0.0
        i = list(routing).index(aux_loss_type)
        return float(coeff[i] if isinstance(coeff, (list, tuple)) else coeff)
    return float(coeff or 0.0) if routing == aux_loss_type else 0.0


def _is_aux_loss_enabled(router: Any) -> bool:
    return any(_aux_loss_coeff(router, t) > 0 for t in ("aux_loss", "seq_aux_loss", "global_aux_loss"))


#: methods later routers have that code written for them (replay patches, MindSpeed features)
#: calls; bound on an instance whose class lacks them
ROUTER_METHODS = {
    "get_aux_loss_coeff": _aux_loss_coeff,
    "is_aux_loss_enabled": _is_aux_loss_enabled,
}


def bind_missing_router_methods(router: Any) -> list[str]:
    """Bind :data:`ROUTER_METHODS` the router's class lacks to this instance (``types.MethodType``;
    the class, shared with every other model, is never touched). Returns the names bound."""
    bound = []
    for name, fn in ROUTER_METHODS.items():
        if hasattr(type(router), name) or name in vars(router):
            continue
        setattr(router, name, types.MethodType(fn, router))
        bound.append(name)
    return bound


def check_replayable_config(config: Any) -> None:
    """Fields whose value makes replay impossible or bypasses the seam (MindSpeed merges its own
    argument namespace into every TransformerConfig, so they can arrive without rlcore asking)."""
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if capacity is not None:
        raise ConfigError(f"moe_expert_capacity_factor={capacity} on the megatron TransformerConfig (MindSpeed's "
                          f"--moe-expert-capacity-factor?): dropped tokens make routes unreplayable; unset it",
                          key="megatron.moe_expert_capacity_factor")
    if getattr(config, "moe_router_fusion", False):
        raise ConfigError("moe_router_fusion is on: the fused router never consults the seam, replay would do "
                          "nothing", key="megatron.moe_router_fusion")
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    if balancing == "sinkhorn" or (isinstance(balancing, (list, tuple)) and "sinkhorn" in balancing):
        raise ConfigError("moe_router_load_balancing_type=sinkhorn routes with its own top-k, outside the routing "
                          "function the seam intercepts: replay would do nothing; use aux_loss or none",
                          key="megatron.moe_router_load_balancing_type")


def check_config_kept(config: Any, requested: Mapping[str, Any]) -> None:
    """Every value rlcore gave the TransformerConfig is still what the built object holds, whether
    it became a dataclass field or an attribute of a class MindSpeed rebuilt (a key the class
    already had as an attribute loses its value there). Raises naming the keys."""
    lost = {}
    for key, want in requested.items():
        have = getattr(config, key, _MISSING)
        if have is _MISSING or not _same(have, want):
            lost[key] = (want, None if have is _MISSING else have)
    if lost:
        detail = "; ".join(f"{k}: asked {w!r}, holds {h!r}" for k, (w, h) in lost.items())
        raise RLCoreError(f"the megatron TransformerConfig ({type(config).__qualname__}) lost values rlcore set "
                          f"({detail}): something rebuilt it without them (MindSpeed's TransformerConfig "
                          f"init wrapper drops an unknown key the class already has as an attribute)")


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or a is b
    except Exception:  # noqa: BLE001 - tensors and such: identity only
        return a is b


# ------------------------------------------------------------------ layer offsets ----------


def transformer_layer_offset(config: Any, vp_stage: int | None = None) -> int:
    """The first global layer number of this pipeline stage (and virtual stage ``vp_stage``).

    ``get_transformer_layer_offset`` takes ``vp_stage`` from megatron-core 0.14 on; 0.12.1's reads
    the virtual-pipeline rank from ``parallel_state`` instead, so there the rank is set for the
    call and put back. Chosen by the function's signature."""
    from megatron.core.transformer import transformer_layer as tl

    fn = tl.get_transformer_layer_offset
    if "vp_stage" in inspect.signature(fn).parameters:
        return int(fn(config, vp_stage=vp_stage))
    if vp_stage is None:
        return int(fn(config))
    from megatron.core import parallel_state as ps

    before = ps.get_virtual_pipeline_model_parallel_rank()
    ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
    try:
        return int(fn(config))
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(before)
