"""A TEST DOUBLE of MindSpeed: its documented patching behaviours, reproduced (our own code).

MindSpeed needs torch_npu and an Ascend machine, so it cannot run here. What rlcore-npu must
cope with is how MindSpeed patches megatron-core, and that is reproduced here from its source
(Ascend/MindSpeed 2.3.0_core_r0.12.1: ``mindspeed/patch_utils.py``, ``megatron_adaptor.py``,
``features_manager/moe/moe_fix_router.py``, ``features_manager/moe/tp_extend_ep.py``,
``core/megatron_basic/arguments_basic.py``):

* ``MindSpeedPatchesManager.register_patch(name, fn)``: a function whose name ends in ``wrapper``
  or ``decorator`` stacks on the target; any other replaces it. ``apply_patches()`` sets the
  target and rewrites *every module in sys.modules that holds the function found at the target*;
  ``remove_patches()`` restores the original in modules (outside mindspeed) that still hold the
  patched function, and forgets the patch functions and wrappers.
* ``megatron_adaptor``: importing it runs ``patch_features()``; ``repatch(args)`` removes every
  patch and applies the features again with the new args. Both end in ``apply_patches()``.
* Features touching the router: ``fix_router`` replaces ``moe_utils.topk_softmax_with_capacity``
  with MindSpeed's own implementation (here: one that computes megatron's result and counts its
  calls, so a test can see it ran); ``moe_tp_extend_ep`` replaces ``TopKRouter.routing`` with a
  routing() that calls the top-k function it imported into its own module.
* ``TransformerConfig.__init__`` wrapper: kwargs merged over MindSpeed's argument namespace,
  split by ``inspect.signature`` of the class; unknown keys rebuild the instance's class with
  ``dataclasses.make_dataclass`` (``init=False`` fields) and are set, except a key the class
  already has as an attribute, whose value is dropped.

:func:`install` puts packages ``mindspeed``, ``mindspeed.patch_utils``,
``mindspeed.megatron_adaptor`` and ``mindspeed.fixture_router`` into sys.modules; :func:`uninstall`
removes every patch and the modules.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from types import SimpleNamespace
from typing import Any

MODULES = ("mindspeed", "mindspeed.patch_utils", "mindspeed.megatron_adaptor", "mindspeed.fixture_router")


class _Patch:
    def __init__(self, target: str):
        self.module_name, self.attr = target.rsplit(".", 1)
        self.replacement = None
        self.wrappers: list = []
        self.original = None
        self.owner = None
        self.applied = None

    def _resolve(self):
        import importlib

        parts = self.module_name.split(".")
        for i in range(len(parts), 0, -1):  # "pkg.mod.Class" -> module pkg.mod, attribute Class
            try:
                owner = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            for name in parts[i:]:
                owner = getattr(owner, name)
            return owner
        raise ModuleNotFoundError(self.module_name)

    def apply(self):
        owner = self._resolve()
        current = getattr(owner, self.attr)
        if self.owner is None:
            self.owner, self.original = owner, current
        final = self.replacement if self.replacement is not None else self.original
        for wrapper in self.wrappers:
            final = wrapper(final)
        setattr(owner, self.attr, final)
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, "__dict__", {}).get(self.attr) is current:
                setattr(module, self.attr, final)
        self.applied = final

    def remove(self):
        for key, module in list(sys.modules.items()):
            if "mindspeed" in key or module is None:
                continue
            if module.__dict__.get(self.attr) is self.applied and self.applied is not None:
                setattr(module, self.attr, self.original)
        if self.owner is not None and getattr(self.owner, self.attr) is self.applied:
            setattr(self.owner, self.attr, self.original)
        self.replacement, self.applied = None, None
        self.wrappers.clear()


class MindSpeedPatchesManager:
    patches_info: dict[str, _Patch] = {}

    @staticmethod
    def register_patch(target, new_func=None, force_patch=False, create_dummy=False):
        patch = MindSpeedPatchesManager.patches_info.setdefault(target, _Patch(target))
        if getattr(new_func, "__name__", "").endswith(("wrapper", "decorator")):
            if new_func not in patch.wrappers:
                patch.wrappers.append(new_func)
        else:
            if patch.replacement is not None and not force_patch:
                raise RuntimeError(f"the patch of {target} exist !")
            patch.replacement = new_func

    @staticmethod
    def remove_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.remove()

    @staticmethod
    def apply_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.apply()


def _fixture_router_module() -> types.ModuleType:
    """MindSpeed's router code: a top-k function of its own and a routing() that calls the top-k
    function imported (by name) into its module, as ``routing_tp_extend_ep`` does."""
    mod = types.ModuleType("mindspeed.fixture_router")
    from megatron.core.transformer.moe import moe_utils

    # megatron's own (0.12/0.13 only: the function these patches target), captured at import
    mod.megatron_topk = getattr(moe_utils, "topk_softmax_with_capacity", None)
    mod.topk_softmax_with_capacity = mod.megatron_topk  # "imported by name"
    mod.calls = {"mindspeed_topk": 0, "mindspeed_routing": 0}

    def mindspeed_topk_softmax_with_capacity(logits, topk, capacity_factor=None, pad_to_capacity=False,
                                             drop_policy="probs", use_pre_softmax=False, num_groups=None,
                                             group_topk=None, scaling_factor=None, deterministic_mode=False,
                                             score_function="softmax", expert_bias=None):
        mod.calls["mindspeed_topk"] += 1
        return mod.megatron_topk(logits, topk, capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity,
                                 drop_policy=drop_policy, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
                                 group_topk=group_topk, scaling_factor=scaling_factor,
                                 deterministic_mode=deterministic_mode, score_function=score_function,
                                 expert_bias=expert_bias)

    def mindspeed_routing(self, logits):
        # the "none" routing of routing_tp_extend_ep, without its TP scatter/gather (TP=1 here)
        mod.calls["mindspeed_routing"] += 1
        logits = logits.view(-1, self.config.num_moe_experts)
        logits = self.apply_z_loss(logits)
        scores, routing_map, _ = mod.topk_softmax_with_capacity(
            logits, self.topk, capacity_factor=self.config.moe_expert_capacity_factor,
            pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
            drop_policy=self.config.moe_token_drop_policy, use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups, group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            deterministic_mode=self.config.deterministic_mode, score_function=self.score_function,
            expert_bias=self.expert_bias)
        return scores, routing_map

    mod.topk = mindspeed_topk_softmax_with_capacity
    mod.routing = mindspeed_routing
    return mod


def transformer_config_init_wrapper(fn):
    """MindSpeed's TransformerConfig.__init__ wrapper (see module docstring)."""

    @functools.wraps(fn)  # as MindSpeed's: inspect.signature of the class then sees fn's parameters
    def wrapper(self, *args, **kwargs):
        merged = dict(vars(sys.modules["mindspeed.megatron_adaptor"].full_args))
        merged.update(kwargs)
        accepted = inspect.signature(self.__class__).parameters
        known = {k: v for k, v in merged.items() if k in accepted}
        unknown = {k: v for k, v in merged.items() if k not in accepted}
        extra = [(k, type(v), dataclasses.field(init=False)) for k, v in unknown.items() if not hasattr(self, k)]
        self.__class__ = dataclasses.make_dataclass(self.__class__.__name__, fields=extra, bases=(self.__class__,))
        for k, v in unknown.items():
            if not hasattr(self, k):
                setattr(self, k, v)
        fn(self, *args, **known)

    return wrapper


def _register_features(manager: Any, args: SimpleNamespace) -> None:
    router = sys.modules["mindspeed.fixture_router"]
    manager.register_patch("megatron.core.transformer.transformer_config.TransformerConfig.__init__",
                           transformer_config_init_wrapper)
    if getattr(args, "fix_router", False):
        manager.register_patch("megatron.core.transformer.moe.moe_utils.topk_softmax_with_capacity", router.topk)
    if getattr(args, "moe_tp_extend_ep", False):
        manager.register_patch("megatron.core.transformer.moe.router.TopKRouter.routing", router.routing)


def install(**args: Any) -> types.ModuleType:
    """Import-time behaviour of ``mindspeed.megatron_adaptor``: register and apply the features
    selected by ``args`` (MindSpeed's argument namespace). Returns the adaptor module, whose
    ``repatch(new_args)`` removes and re-applies every patch."""
    pkg = types.ModuleType("mindspeed")
    pkg.__path__ = []  # a package, so importlib finds its submodules in sys.modules
    pkg.IS_TEST_DOUBLE = True
    patch_utils = types.ModuleType("mindspeed.patch_utils")
    patch_utils.MindSpeedPatchesManager = MindSpeedPatchesManager
    MindSpeedPatchesManager.patches_info = {}
    sys.modules["mindspeed"] = pkg
    sys.modules["mindspeed.patch_utils"] = patch_utils
    sys.modules["mindspeed.fixture_router"] = _fixture_router_module()
    adaptor = types.ModuleType("mindspeed.megatron_adaptor")
    adaptor.full_args = SimpleNamespace(**args)

    def patch_features():
        _register_features(MindSpeedPatchesManager, adaptor.full_args)
        MindSpeedPatchesManager.apply_patches()

    def repatch(new_args):
        MindSpeedPatchesManager.remove_patches()
        for k, v in new_args.items():
            setattr(adaptor.full_args, k, v)
        _register_features(MindSpeedPatchesManager, adaptor.full_args)
        MindSpeedPatchesManager.apply_patches()

    adaptor.patch_features, adaptor.repatch = patch_features, repatch
    sys.modules["mindspeed.megatron_adaptor"] = adaptor
    patch_features()
    return adaptor


def uninstall() -> None:
    manager = MindSpeedPatchesManager
    if "mindspeed.patch_utils" in sys.modules:
        manager = sys.modules["mindspeed.patch_utils"].MindSpeedPatchesManager
    manager.remove_patches()
    apply = manager.__dict__.get("apply_patches")
    fn = apply.__func__ if isinstance(apply, staticmethod) else apply
    while getattr(fn, "__wrapped__", None) is not None:  # rlcore-npu's after-apply hook
        fn = fn.__wrapped__
    manager.apply_patches = staticmethod(fn)
    for name in MODULES:
        sys.modules.pop(name, None)
