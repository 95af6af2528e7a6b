"""rlcore-megatron's public seam (rlcore_megatron.seams), as another plugin (rlcore-npu) uses it:
a listener sees every router seam an engine installs and can refuse the model; a patcher that
replaced megatron-core's routing function puts the seam back with reinstall_interception."""

from __future__ import annotations

import pytest
from rlcore.errors import ConfigError
from rlcore.testing.imports import modules_loaded_by

pytestmark = pytest.mark.engine("megatron")

pytest.importorskip("megatron.core")


def _engine(tiny_model_dirs):
    from rlcore_megatron.engine import HFSource, MegatronEngine

    return MegatronEngine(HFSource.from_dir(tiny_model_dirs["moe_a"]))


def test_importing_the_seam_loads_neither_torch_nor_megatron():
    assert modules_loaded_by("import rlcore_megatron.seams", ["torch", "megatron"]) == []


def test_a_listener_sees_every_seam_and_can_refuse_the_model(tiny_model_dirs):
    from rlcore_megatron import seams

    seen = []

    def listener(seam):
        seen.append([(s.layer, s.routed_index, s.num_experts, s.topk, type(s.router).__name__) for s in seam.sites])
        seen.append(seam.config.num_moe_experts)

    def refuse(seam):
        raise ConfigError("this platform cannot run these routers", key="engine.model")

    seams.add_listener(listener)
    seams.add_listener(listener)  # once only
    try:
        engine = _engine(tiny_model_dirs)
        sites = [(s.layer, s.routed_index, s.num_experts, s.topk, type(s.router).__name__) for s in engine.seam.sites]
        assert seen == [sites, engine.seam.config.num_moe_experts]
        assert sites and all(name == "TopKRouter" for *_, name in sites)
        seams.add_listener(refuse)
        with pytest.raises(ConfigError, match="cannot run these routers"):
            _engine(tiny_model_dirs)
    finally:
        seams.remove_listener(listener)
        seams.remove_listener(refuse)
    seen.clear()
    _engine(tiny_model_dirs)
    assert seen == [], "a removed listener is not called"


def test_reinstall_interception_puts_the_seam_back_after_a_patcher_replaced_it(tiny_model_dirs):
    import megatron.core.transformer.moe.router as router_mod
    from rlcore_megatron import seams

    engine = _engine(tiny_model_dirs)
    if engine.seam.mode == "native":
        assert not seams.reinstall_interception(), "native RouterReplay (megatron-core >= 0.16): nothing to wrap"
        return
    name = next(n for n in ("topk_routing_with_score_function", "topk_softmax_with_capacity") if hasattr(router_mod, n))
    wrapper = getattr(router_mod, name)
    assert seams.interception_installed()

    def patched(*args, **kwargs):  # what a patcher puts in place: megatron's function under its own
        return wrapper.__wrapped__(*args, **kwargs)

    setattr(router_mod, name, patched)
    try:
        assert not seams.interception_installed()
        assert seams.reinstall_interception()
        assert seams.interception_installed() and getattr(router_mod, name).__wrapped__ is patched
    finally:
        setattr(router_mod, name, wrapper)
