"""rlcore-npu's MindSpeed / megatron-core 0.12.1 compatibility, against the real megatron-core
(0.12.1 and 0.16.1 on CPU, in the megatron suites' venvs) with MindSpeed's patching behaviours
reproduced by the MindSpeed TEST DOUBLE (mindspeed_double.py; MindSpeed itself needs an Ascend
machine and was not run).

The replay proof under MindSpeed: with MindSpeed's top-k and routing() patches in place, record,
perturb the routers, replay — the routers use exactly the recorded experts, and MindSpeed's own
functions still ran; again after ``repatch``; and without rlcore-npu's re-installation a repatch
makes the seam refuse to run instead of routing natively."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.engine("megatron")

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from omegaconf import OmegaConf  # noqa: E402
from rlcore.batch import PackedBatch  # noqa: E402
from rlcore.errors import ConfigError, RLCoreError  # noqa: E402
from rlcore.types import MicroBatchContext  # noqa: E402
from rlcore_megatron.testing import perturb_routers  # noqa: E402

ROUTING_NAMES = ("topk_routing_with_score_function", "topk_softmax_with_capacity")
SEQS = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2]]


def _routing_name() -> str:
    import megatron.core.transformer.moe.router as router_mod

    return next(n for n in ROUTING_NAMES if hasattr(router_mod, n))


@pytest.fixture
def mindspeed(monkeypatch):
    """``mindspeed(**args)``: MindSpeed's adaptor imported (the double) with these arguments;
    everything it and rlcore-npu patched is put back afterwards."""
    import megatron.core.transformer.moe.router as router_mod
    import mindspeed_double
    from rlcore_megatron import seams
    from rlcore_npu.mindspeed import adapt_seam

    name = _routing_name()
    holders = {mod: mod.__dict__[name] for mod in list(sys.modules.values())
               if mod is not None and name in getattr(mod, "__dict__", {})}
    routing_before = router_mod.TopKRouter.routing

    def install(**args):
        router_patches = args.get("fix_router") or args.get("moe_tp_extend_ep")
        if router_patches and name != "topk_softmax_with_capacity":
            pytest.skip(f"MindSpeed's router patches target megatron-core 0.12.1 ({name} here)")
        return mindspeed_double.install(**args)

    yield install
    mindspeed_double.uninstall()
    router_mod.TopKRouter.routing = routing_before
    for mod, fn in holders.items():
        setattr(mod, name, fn)
    seams.remove_listener(adapt_seam)


def _engine(tiny_model_dirs, **settings):
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.settings import MegatronSettings

    return MegatronEngine(HFSource.from_dir(tiny_model_dirs["moe_a"]), MegatronSettings(**settings))


def _replayer(mode="R3"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "replay" / "src"))
    from rlcore_replay.replay import Replayer

    return Replayer(OmegaConf.create({"replay": {"mode": mode, "on_missing": "error", "mtp": "replay",
                                                 "agreement": True}}))


def _replay(engine, batch):
    rep = _replayer()
    ctx = MicroBatchContext(step=0, phase="train", index=0, count=1, batch=batch, config=rep.config)
    rep.forward_request(ctx)
    with torch.no_grad():
        out = engine.forward(batch, record_routes=True, router=rep.router_hook, micro_batch=ctx)
    rep.postprocess(ctx, SimpleNamespace(engine=out))
    return out, rep.step_end(SimpleNamespace(step=0, batch=batch))


def _record_perturb_replay(engine):
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        recorded = engine.forward(batch, record_routes=True).routes
        perturb_routers(engine)
        native = engine.forward(batch, record_routes=True).routes
    assert not torch.equal(native, recorded), "the perturbation must change native routing"
    batch.fields["routes"] = recorded
    out, metrics = _replay(engine, batch)
    assert torch.equal(out.routes, recorded), "the routers must use exactly the recorded experts"
    assert metrics["replay/coverage"] == 1.0 and metrics["replay/agreement"] < 1.0
    return metrics


def test_replay_coexists_with_mindspeeds_router_patches_and_survives_repatch(mindspeed, tiny_model_dirs):
    from rlcore_megatron.seams import interception_installed
    from rlcore_npu.mindspeed import setup_mindspeed

    adaptor = mindspeed(fix_router=True, moe_tp_extend_ep=True)
    ms_router = sys.modules["mindspeed.fixture_router"]
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.router as router_mod

    assert router_mod.TopKRouter.routing is ms_router.routing  # MindSpeed patched first
    assert moe_utils.topk_softmax_with_capacity is ms_router.topk
    assert setup_mindspeed("required")  # the adaptor is loaded: compatibility on
    engine = _engine(tiny_model_dirs)
    # the seam wraps MindSpeed's top-k in every module holding it, MindSpeed's own module included
    for mod in (router_mod, moe_utils, ms_router):
        fn = mod.topk_softmax_with_capacity
        assert getattr(fn, "_rlcore_router_seam", False) and fn.__wrapped__ is ms_router.topk, mod.__name__
    calls = dict(ms_router.calls)
    _record_perturb_replay(engine)
    assert ms_router.calls["mindspeed_routing"] > calls["mindspeed_routing"], "MindSpeed's routing() ran"
    assert ms_router.calls["mindspeed_topk"] > calls["mindspeed_topk"], "MindSpeed's top-k ran"

    adaptor.repatch({"fix_router": True})  # remove every patch, apply again: the seam follows
    assert interception_installed()
    assert router_mod.TopKRouter.routing is ms_router.routing
    _record_perturb_replay(engine)


def test_without_the_reinstallation_a_repatch_makes_replay_refuse_not_route_natively(mindspeed, tiny_model_dirs):
    from rlcore_npu.mindspeed import setup_mindspeed

    adaptor = mindspeed(fix_router=True)
    setup_mindspeed("required")
    engine = _engine(tiny_model_dirs)
    manager = sys.modules["mindspeed.patch_utils"].MindSpeedPatchesManager
    manager.apply_patches = staticmethod(manager.apply_patches.__wrapped__)  # rlcore-npu's hook removed
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        batch.fields["routes"] = engine.forward(batch, record_routes=True).routes
    adaptor.repatch({"fix_router": True})
    with torch.no_grad():
        engine.forward(batch)  # a forward that neither records nor replays still runs
    with pytest.raises(RLCoreError, match="no longer rlcore's router seam.*MindSpeed's repatch"):
        _replay(engine, batch)
    with pytest.raises(RLCoreError, match="no longer rlcore's router seam"), torch.no_grad():
        engine.forward(batch, record_routes=True)


def test_mindspeed_arguments_that_break_replay_are_refused_when_the_model_is_built(mindspeed, tiny_model_dirs):
    from rlcore_npu.mindspeed import setup_mindspeed

    # MindSpeed merges its argument namespace into every TransformerConfig: rlcore never asked
    # for token dropping, MindSpeed's --moe-expert-capacity-factor brings it
    mindspeed(moe_expert_capacity_factor=1.0)
    setup_mindspeed("required")
    with pytest.raises(ConfigError, match="moe_expert_capacity_factor=1.0.*unreplayable") as err:
        _engine(tiny_model_dirs)
    assert err.value.key == "megatron.moe_expert_capacity_factor"


def test_transformer_config_rebuilt_by_mindspeed_keeps_rlcores_values_or_says_which_were_lost(mindspeed,
                                                                                              monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from rlcore_megatron.compat import transformer_config
    from rlcore_npu.mindspeed import check_config_kept

    mindspeed(use_fused_rmsnorm=True, some_mindspeed_only_flag=3)  # MindSpeed-only arguments
    required = dict(num_layers=2, hidden_size=64, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
                    moe_router_load_balancing_type="none", add_bias_linear=False, use_cpu_initialization=True)
    config = transformer_config(required, {})
    assert type(config) is not TransformerConfig and isinstance(config, TransformerConfig)  # rebuilt class
    assert config.use_fused_rmsnorm is True and config.some_mindspeed_only_flag == 3  # unknown keys: fields
    check_config_kept(config, required)
    # a setting another plugin declared as a class attribute: MindSpeed's wrapper drops its value
    monkeypatch.setattr(TransformerConfig, "replay_mode", "off", raising=False)
    config = TransformerConfig(**required, replay_mode="R3")
    assert config.replay_mode == "off"
    with pytest.raises(RLCoreError, match="lost values rlcore set .*replay_mode: asked 'R3', holds 'off'"):
        check_config_kept(config, {**required, "replay_mode": "R3"})


def test_router_methods_later_cores_have_are_bound_per_instance_when_missing(tiny_model_dirs):
    from rlcore_npu.mindspeed import ROUTER_METHODS, bind_missing_router_methods

    for coeff in (0.0, 0.01):
        engine = _engine(tiny_model_dirs, moe_aux_loss_coeff=coeff)
        router = engine.seam.sites[0].router
        cls = type(router)
        native = {n: getattr(cls, n, None) for n in ROUTER_METHODS}
        bound = bind_missing_router_methods(router)
        assert bound == [n for n, fn in native.items() if fn is None]
        assert all(getattr(cls, n, None) is native[n] for n in ROUTER_METHODS), "the class is never touched"
        if native["is_aux_loss_enabled"] is not None:  # 0.14+: ours must agree with megatron's own
            assert ROUTER_METHODS["is_aux_loss_enabled"](router) == router.is_aux_loss_enabled()
        else:  # 0.12.1: bound on this instance only
            assert "is_aux_loss_enabled" in vars(router)
            assert not hasattr(type(engine.seam.sites[1].router), "is_aux_loss_enabled")
        assert router.is_aux_loss_enabled() is (coeff > 0)
        assert router.get_aux_loss_coeff("aux_loss") == pytest.approx(coeff)


def test_layer_offset_is_called_by_signature_with_or_without_vp_stage(monkeypatch):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import transformer_layer as tl
    from rlcore_npu.mindspeed import transformer_layer_offset

    takes_vp = "vp_stage" in inspect.signature(tl.get_transformer_layer_offset).parameters
    # stage 1 of 2 pipeline stages with 2 virtual stages each, simulated in parallel_state
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda *a, **k: 1)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda *a, **k: 2)
    if hasattr(ps, "get_pipeline_model_parallel_decoder_start"):
        monkeypatch.setattr(ps, "get_pipeline_model_parallel_decoder_start", lambda *a, **k: None)
    if hasattr(ps, "is_inside_encoder"):
        monkeypatch.setattr(ps, "is_inside_encoder", lambda *a, **k: False)
    config = SimpleNamespace(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                             num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                             account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
                             pipeline_model_parallel_layout=None, mtp_num_layers=None)
    before = ps.get_virtual_pipeline_model_parallel_rank()
    offsets = [transformer_layer_offset(config, vp_stage=v) for v in (0, 1)]
    assert ps.get_virtual_pipeline_model_parallel_rank() == before, "the virtual rank is put back"
    expected = []
    for v in (0, 1):  # megatron's own answer for each virtual stage, asked its own way
        if takes_vp:
            expected.append(tl.get_transformer_layer_offset(config, vp_stage=v))
        else:
            ps.set_virtual_pipeline_model_parallel_rank(v)
            expected.append(tl.get_transformer_layer_offset(config))
            ps.set_virtual_pipeline_model_parallel_rank(before)
    assert offsets == expected and offsets[0] != offsets[1], (offsets, expected)
