"""One test per hook spec (docs discipline: tests/test_docs.py fails if a hook has none)."""

import textwrap
import types
from dataclasses import dataclass

import pytest
import torch

from rlcore import errors
from rlcore.batch import PackedBatch
from rlcore.stack import resolve
from rlcore.types import (
    EngineSpec,
    ForwardFnSpec,
    ForwardRequest,
    MicroBatchContext,
    PlatformSpec,
    PluginSettings,
    RolloutBackendSpec,
    RouterDecision,
    StepContext,
    WeightSyncSpec,
)


def _module(name, src):
    mod = types.ModuleType(name)
    exec(textwrap.dedent(src), mod.__dict__)
    return mod


def _provider_module(name, hook, spec_cls, provider):
    mod = types.ModuleType(name)
    mod.PLUGIN_API = 1
    from rlcore import hookimpl

    def impl():
        yield spec_cls(name=provider, factory=lambda ctx: ("built", provider), capabilities={"x"})

    impl.__name__ = hook
    setattr(mod, hook, hookimpl(impl))
    return mod


@pytest.mark.parametrize("hook,spec_cls,getter", [
    ("forward_fn", ForwardFnSpec, "forward_fns"),
])
def test_hook_forward_fn(rlcore_plugin_manager, register_plugin, hook, spec_cls, getter):
    register_plugin(_provider_module("heads_plugin", hook, spec_cls, "myhead"), "heads_plugin",
                    distribution="acme-heads", version="2.0")
    specs = getattr(rlcore_plugin_manager, getter)()
    assert set(specs) == {"reference", "myhead"}
    spec = rlcore_plugin_manager.select(hook, "MyHead", key="forward.name")  # names are normalised
    assert spec.distribution == "acme-heads 2.0" and spec.plugin == "heads_plugin"
    assert spec.factory(None) == ("built", "myhead") and spec.capabilities == frozenset({"x"})


def test_hook_rollout_backend(rlcore_plugin_manager, register_plugin):
    register_plugin(_provider_module("rb", "rollout_backend", RolloutBackendSpec, "remote"), "rb")
    assert set(rlcore_plugin_manager.rollout_backends()) == {"local", "remote"}
    assert rlcore_plugin_manager.select("rollout_backend", "remote", key="rollout.backend").plugin == "rb"


def test_hook_weight_sync(rlcore_plugin_manager, register_plugin):
    register_plugin(_provider_module("ws", "weight_sync", WeightSyncSpec, "rdma"), "ws")
    assert set(rlcore_plugin_manager.weight_syncs()) == {"inproc", "disk", "rdma"}  # mapped is rlcore-ray's


def test_hook_engine(rlcore_plugin_manager, register_plugin):
    register_plugin(_provider_module("eng", "engine", EngineSpec, "jax"), "eng")
    assert set(rlcore_plugin_manager.engines()) >= {"hf", "jax"}


def test_hook_platform(rlcore_plugin_manager, register_plugin):
    from rlcore.platforms import TorchDevicePlatform, resolve_device

    activated = []

    def activate(ctx):
        activated.append(ctx)  # the vendor import would happen here, only when selected
        return TorchDevicePlatform("cpu", "test-collectives")

    mod = types.ModuleType("xpu_plugin")
    mod.PLUGIN_API = 1
    from rlcore import hookimpl

    @hookimpl
    def platform():
        yield PlatformSpec(name="xpu", factory=activate, device_type="cpu", dist_backend="test-collectives",
                           is_available=lambda: False)

    mod.platform = platform
    register_plugin(mod, "xpu_plugin", distribution="acme-xpu", version="1.0")
    specs = rlcore_plugin_manager.platforms()
    assert set(specs) == {"cpu", "cuda", "xpu"}
    assert specs["cpu"].dist_backend == "gloo" and specs["cuda"].dist_backend == "nccl"
    assert specs["xpu"].distribution == "acme-xpu 1.0" and not specs["xpu"].available()
    assert activated == []  # listing never activates
    got = resolve_device("xpu:0", specs, ctx="the-ctx", select=rlcore_plugin_manager.select)
    assert activated == ["the-ctx"] and got.spec.name == "xpu" and got.platform.dist_backend == "test-collectives"
    with pytest.raises(errors.UnknownProviderError, match="engine.device.*'npu'.*rlcore-npu"):
        resolve_device("npu", specs, select=rlcore_plugin_manager.select)


def test_provider_hook_must_return_descriptors(rlcore_plugin_manager):
    mod = _module("wrong", """
        from rlcore import PLUGIN_API, hookimpl
        @hookimpl
        def forward_fn():
            return ["reference-but-a-string"]
    """)
    with pytest.raises(errors.PluginValidationError, match="must return ForwardFnSpec objects, got str"):
        rlcore_plugin_manager.register(mod, "wrong")


def _ctx(phase="train"):
    batch = PackedBatch.pack([[1, 2, 3], [4, 5]], [1, 1])
    return MicroBatchContext(step=0, phase=phase, index=0, count=1, batch=batch)


CHAIN_SRC = """
    from rlcore import PLUGIN_API, hookimpl
    from rlcore.types import PostprocessResult, ForwardRequest, RouterDecision
    import torch
    @hookimpl
    def postprocess(ctx, output):
        return PostprocessResult(metrics={{"who": {tag}}})
    @hookimpl
    def router_hook(call):
        # experts tag, tag+1, ... for every token (distinct within a row, as the contract asks)
        return RouterDecision(indices=(torch.arange(call.topk) + {tag}).expand(call.num_tokens, -1))
    @hookimpl
    def step_end(ctx):
        return {{"last": {tag}}}
"""


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_hook_postprocess(rlcore_plugin_manager, register_plugin, order):
    mods = {"a": _module("a", CHAIN_SRC.format(tag=1)), "b": _module("b", CHAIN_SRC.format(tag=2))}
    for name in order:
        register_plugin(mods[name], name)
    results = rlcore_plugin_manager.postprocess(_ctx(), output=None)
    assert [name for name, _ in results] == list(order)  # config order, not pluggy's LIFO
    assert [r.metrics["who"] for _, r in results] == [1 if n == "a" else 2 for n in order]


def test_hook_postprocess_rejects_wrong_return(rlcore_plugin_manager, register_plugin):
    register_plugin(_module("bad", """
        from rlcore import PLUGIN_API, hookimpl
        @hookimpl
        def postprocess(ctx, output):
            return {"loss": 1.0}
    """), "bad")
    with pytest.raises(errors.PluginValidationError, match="Plugin 'bad' .*hook 'postprocess' must return PostprocessResult, got dict"):
        rlcore_plugin_manager.postprocess(_ctx(), output=None)


def test_hook_router_hook(rlcore_plugin_manager, register_plugin, tiny_model_dirs):
    from rlcore.engines.hf import HFEngine

    silent = _module("silent", """
        from rlcore import PLUGIN_API, hookimpl
        @hookimpl
        def router_hook(call):
            return None
    """)
    register_plugin(silent, "silent")
    register_plugin(_module("b", CHAIN_SRC.format(tag=2)), "b")
    register_plugin(_module("a", CHAIN_SRC.format(tag=1)), "a")
    assert rlcore_plugin_manager.has_router_hooks()
    engine = HFEngine.from_pretrained(tiny_model_dirs["moe_a"])
    batch = PackedBatch.pack([[3, 4, 5, 6], [7, 8]], [1, 1])
    with torch.no_grad():
        out = engine.forward(batch, record_routes=True, router=rlcore_plugin_manager.router_hook)
    # "silent" answers None, so "b" (next in config order) wins and "a" is never asked
    topk = out.routes.shape[-1]
    assert torch.equal(out.routes, (torch.arange(topk, dtype=out.routes.dtype) + 2).expand_as(out.routes))


def test_router_hook_answers_are_checked_on_the_hf_engine(tiny_model_dirs):
    from rlcore.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(tiny_model_dirs["moe_a"])
    batch = PackedBatch.pack([[3, 4, 5, 6], [7, 8]], [1, 1])
    layout = engine.info.route_layout
    k = layout.topk
    with torch.no_grad():
        native = engine.forward(batch, record_routes=True)
        keep = torch.full((batch.num_tokens, k), -1, dtype=torch.long)
        same = engine.forward(batch, record_routes=True, router=lambda c: RouterDecision(indices=keep))
        assert torch.equal(same.routes, native.routes) and torch.equal(same.hidden, native.hidden)
        twice = torch.zeros((batch.num_tokens, k), dtype=torch.long)
        with pytest.raises(errors.BatchShapeError, match=f"layer {layout.layers[0]} chose an expert twice"):
            engine.forward(batch, router=lambda c: RouterDecision(indices=twice))
        with pytest.raises(errors.BatchShapeError, match=r"expected integer \[num_tokens=6"):
            engine.forward(batch, router=lambda c: RouterDecision(indices=twice[:3]))
        with pytest.raises(errors.BatchShapeError, match="expected integer"):
            engine.forward(batch, router=lambda c: RouterDecision(indices=twice.float()))
        outside = torch.arange(k).expand(batch.num_tokens, -1) + layout.num_experts
        with pytest.raises(errors.BatchShapeError, match=f"outside \\[0, {layout.num_experts}\\)"):
            engine.forward(batch, router=lambda c: RouterDecision(indices=outside))


def test_hook_forward_request(rlcore_plugin_manager, register_plugin):
    register_plugin(_module("r1", """
        from rlcore import PLUGIN_API, hookimpl
        from rlcore.types import ForwardRequest
        @hookimpl
        def forward_request(ctx):
            return ForwardRequest(record_routes=ctx.phase == "old_logprob")
    """), "r1")
    register_plugin(_module("r2", """
        from rlcore import PLUGIN_API, hookimpl
        from rlcore.types import ForwardRequest
        @hookimpl
        def forward_request(ctx):
            return ForwardRequest(mtp_hidden=ctx.phase == "train")
    """), "r2")
    assert rlcore_plugin_manager.forward_request(_ctx("old_logprob")) == ForwardRequest(record_routes=True)
    assert rlcore_plugin_manager.forward_request(_ctx("train")) == ForwardRequest(mtp_hidden=True)
    # native_logprobs merges like the others (any True wins)
    merged = ForwardRequest(record_routes=True).merge(ForwardRequest(native_logprobs=True))
    assert merged == ForwardRequest(record_routes=True, native_logprobs=True)


def test_hook_step_end(rlcore_plugin_manager, register_plugin):
    register_plugin(_module("a", CHAIN_SRC.format(tag=1)), "a")
    register_plugin(_module("b", CHAIN_SRC.format(tag=2)), "b")
    ctx = StepContext(step=3, batch=_ctx().batch, metrics={})
    assert rlcore_plugin_manager.step_end(ctx) == {"last": 2}  # later plugins override earlier keys


@dataclass
class _KnobSettings:
    knob: int = 3
    mode: str = "a"


def test_hook_plugin_settings(rlcore_plugin_manager, register_plugin, rlcore_config):
    mod = _module("knobs", "from rlcore import PLUGIN_API, hookimpl\n")
    mod.plugin_settings = __import__("rlcore").hookimpl(lambda: PluginSettings(section="knobs", schema=_KnobSettings))
    mod.plugin_settings.__name__ = "plugin_settings"
    register_plugin(mod, "knobs")
    cfg = rlcore_config("knobs.knob=7")
    assert cfg.knobs.knob == 7 and cfg.knobs.mode == "a"
    with pytest.raises(errors.ConfigError, match="unknown config key 'knobs.nob'"):
        rlcore_config("knobs.nob=1")
    with pytest.raises(errors.ConfigError, match="knobs.knob"):
        rlcore_config("knobs.knob=many")
    twin = _module("knobs2", "from rlcore import PLUGIN_API, hookimpl\n")
    twin.plugin_settings = mod.plugin_settings
    register_plugin(twin, "knobs2")
    with pytest.raises(errors.PluginConflictError, match="Config section 'knobs' is claimed by plugin 'knobs'"):
        rlcore_plugin_manager.plugin_settings()


def test_plugin_settings_validate_runs_at_config_time(rlcore_plugin_manager, register_plugin, rlcore_config):
    def check(section):
        if section.mode not in ("a", "b"):
            raise errors.ConfigError(f"bad value for config key 'knobs.mode': {section.mode!r}", key="knobs.mode")

    mod = _module("knobs", "from rlcore import PLUGIN_API, hookimpl\n")
    mod.plugin_settings = __import__("rlcore").hookimpl(
        lambda: PluginSettings(section="knobs", schema=_KnobSettings, validate=check))
    mod.plugin_settings.__name__ = "plugin_settings"
    register_plugin(mod, "knobs")
    assert rlcore_config("knobs.mode=b").knobs.mode == "b"
    with pytest.raises(errors.ConfigError, match="bad value for config key 'knobs.mode': 'zzz'"):
        rlcore_config("knobs.mode=zzz")


def test_hook_constraints(rlcore_plugin_manager, register_plugin, rlcore_config):
    register_plugin(_module("picky", """
        from rlcore import PLUGIN_API, hookimpl
        from rlcore.types import RequiresCapability
        @hookimpl
        def constraints():
            yield RequiresCapability("forward_fn", "entropy", reason="entropy bonus")
            yield RequiresCapability("forward_fn", "fp8", reason="fp8 head", when=lambda cfg: cfg.rollout.n == 99)
    """), "picky")
    stack = resolve(rlcore_config(), rlcore_plugin_manager)  # reference has entropy; fp8 rule inactive
    assert stack.forward_fn.name == "reference"
    assert [type(c).__name__ for owner, c in rlcore_plugin_manager.constraints()
            if owner == "picky"] == ["RequiresCapability"] * 2  # the built-in ppo declares its own
    with pytest.raises(errors.MissingCapabilityError, match="capability 'fp8' \\(fp8 head\\)"):
        resolve(rlcore_config("rollout.n=99"), rlcore_plugin_manager)
