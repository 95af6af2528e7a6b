"""rlcore-replay's Replayer driving the megatron engine's router seam (megatron-core 0.12.1:
interception of the routing function in the router module and in moe_utils; 0.16.1: native
``RouterReplay``): record, perturb the routers, replay — the routers use exactly the recorded
experts; on unchanged weights replay is bit-identical; recomputation in backward replays again."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from rlcore.batch import PackedBatch
from rlcore.errors import BatchShapeError, RLCoreError
from rlcore.types import MicroBatchContext, RouterDecision
from rlcore_megatron.testing import perturb_routers

pytestmark = pytest.mark.engine("megatron")

ROOT = Path(__file__).resolve().parents[3]
# the megatron venvs install rlcore and rlcore-megatron; rlcore-replay needs nothing more (torch +
# rlcore), so its source tree is put on the path rather than installed
sys.path.insert(0, str(ROOT / "plugins" / "replay" / "src"))
from rlcore_replay.replay import Replayer  # noqa: E402

SEQS = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2]]


@pytest.fixture
def fresh(megatron_dirs):
    """A MegatronEngine of its own (its routers get perturbed)."""
    from rlcore_megatron.engine import HFSource, MegatronEngine

    return lambda name: MegatronEngine(HFSource.from_dir(megatron_dirs[name]))


def _cfg(mode="R3", **kw):
    return OmegaConf.create({"replay": {"mode": mode, "on_missing": "error", "mtp": kw.get("mtp", "replay"),
                                        "agreement": kw.get("agreement", False)}})


def _replay(engine, rep, batch, phase="train", mtp_hidden=False):
    ctx = MicroBatchContext(step=0, phase=phase, index=0, count=1, batch=batch, config=rep.config)
    rep.forward_request(ctx)
    out = engine.forward(batch, record_routes=True, router=rep.router_hook, micro_batch=ctx, mtp_hidden=mtp_hidden)
    rep.postprocess(ctx, SimpleNamespace(engine=out))
    return out


def test_interception_replaces_the_function_in_the_router_module_and_where_it_is_defined(fresh):
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.router as router_mod

    engine = fresh("moe_a")
    if engine.seam.mode == "native":
        assert "router_replay" in str(engine.seam.sites[0].router.router_replay.__class__.__mro__)
        pytest.skip("megatron-core >= 0.16: native RouterReplay, no interception")
    names = [n for n in ("topk_routing_with_score_function", "topk_softmax_with_capacity") if hasattr(router_mod, n)]
    fn = getattr(router_mod, names[0])
    assert getattr(fn, "_rlcore_router_seam", False)
    assert getattr(moe_utils, names[0]) is fn, "moe_utils' binding goes through the seam as well"


def test_replay_forces_recorded_experts_after_the_routers_change(fresh, figures):
    engine = fresh("moe_a")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        recorded = engine.forward(batch, record_routes=True).routes
        perturb_routers(engine)
        native = engine.forward(batch, record_routes=True).routes
    assert not torch.equal(native, recorded), "the perturbation must change native routing"
    batch.fields["routes"] = recorded
    rep = Replayer(_cfg("R3", agreement=True))
    with torch.no_grad():
        out = _replay(engine, rep, batch)
    assert torch.equal(out.routes, recorded)
    m = rep.step_end(SimpleNamespace(step=0, batch=batch))
    assert m["replay/coverage"] == 1.0 and m["replay/agreement"] < 1.0
    figures(f"replay after router perturbation ({engine.seam.mode})",
            f"experts equal the recorded ones; native agreement {m['replay/agreement']:.3f}")


def test_replay_on_unchanged_weights_is_bit_identical_and_mtp_gets_its_own_rows(fresh):
    engine = fresh("moe_mtp")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        base = engine.forward(batch, record_routes=True, mtp_hidden=True)
    routes = base.routes.clone()
    batch.fields["routes"] = routes
    rep = Replayer(_cfg("R3"))
    with torch.no_grad():
        out = _replay(engine, rep, batch, mtp_hidden=True)
    assert torch.equal(out.hidden, base.hidden) and torch.equal(out.routes, routes)
    # an MTP column different from decoder layer 0's: the MTP router replays its own rows
    perturb_routers(engine)
    batch.fields["routes"] = routes
    rep = Replayer(_cfg("R3"))
    with torch.no_grad():
        out = _replay(engine, rep, batch, mtp_hidden=True)
    assert torch.equal(out.routes[:, 2], routes[:, 2])
    # mtp: native — the decoder replays, the MTP router routes on its own scores
    def decoder_only(call):
        return None if call.is_mtp else RouterDecision(indices=routes[:, call.routed_index].long())

    rep = Replayer(_cfg("R3", mtp="native"))
    with torch.no_grad():
        nat = engine.forward(batch, record_routes=True, mtp_hidden=True, router=decoder_only).routes
        out = _replay(engine, rep, batch, mtp_hidden=True)
    assert torch.equal(out.routes, nat) and torch.equal(out.routes[:, :2], routes[:, :2])
    assert not torch.equal(out.routes[:, 2], routes[:, 2])


def test_route_tensor_wider_than_the_model_is_an_error(fresh):
    engine = fresh("moe_a")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        recorded = engine.forward(batch, record_routes=True).routes
    batch.fields["routes"] = torch.cat([recorded, recorded[:, :1]], dim=1)
    rep = Replayer(_cfg("R3"))
    with pytest.raises(BatchShapeError, match="were never consumed"), torch.no_grad():
        _replay(engine, rep, batch)


class _RunInBackward(torch.autograd.Function):
    """Calls ``fn`` during backward, as activation recomputation would re-run a router."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.fn()
        return g, None


def test_a_router_rerun_in_backward_replays_the_forward_experts(fresh):
    engine = fresh("moe_a")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        recorded = engine.forward(batch, record_routes=True).routes
        perturb_routers(engine)
    site = engine.seam.sites[0]
    calls = []

    def dispatch(call):
        calls.append(call.recompute)
        return RouterDecision(indices=recorded[:, call.routed_index].long())

    seen = {}
    real_decide = engine.seam.decide

    def capture(s, scores, native_idx):  # the router's own inputs, to re-run it as recomputation would
        if s is site and "scores" not in seen:
            seen.update(scores=scores.detach(), native=native_idx)
        return real_decide(s, scores, native_idx)

    engine.seam.decide = capture
    out = engine.forward(batch, router=dispatch)
    engine.seam.decide = real_decide
    scores, native = seen["scores"], seen["native"]
    got = {}
    y = _RunInBackward.apply(out.hidden, lambda: got.setdefault("idx", engine.seam.decide(site, scores, native)))
    y.sum().backward()
    assert calls[-1] is True
    assert torch.equal(engine.seam.last.from_rows(got["idx"]), recorded[:, 0].long())
    # a dispatcher that answers otherwise under recomputation is refused
    out = engine.forward(batch, router=dispatch)
    engine.seam.last.dispatch = lambda call: RouterDecision(indices=recorded[:, call.routed_index].long().flip(-1))
    y = _RunInBackward.apply(out.hidden, lambda: engine.seam.decide(site, scores, native))
    with pytest.raises(RLCoreError, match="other experts under activation recomputation"):
        y.sum().backward()


def test_r2_records_in_the_old_logprob_pass_and_replays_in_the_update(fresh):
    engine = fresh("moe_a")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    rep = Replayer(_cfg("R2"))
    old = MicroBatchContext(step=0, phase="old_logprob", index=0, count=1, batch=batch, config=rep.config)
    req = rep.forward_request(old)
    assert req is not None and req.record_routes
    with torch.no_grad():
        out = engine.forward(batch, record_routes=True, router=rep.router_hook, micro_batch=old)
    res = rep.postprocess(old, SimpleNamespace(engine=out))
    for k, v in res.batch_updates.items():
        batch.write_back(batch, k, v)
    perturb_routers(engine)
    with torch.no_grad():
        assert not torch.equal(engine.forward(batch, record_routes=True).routes, out.routes)
        again = _replay(engine, rep, batch, phase="train")
    assert torch.equal(again.routes, out.routes)
    assert rep.step_end(SimpleNamespace(step=0, batch=batch))["replay/bytes_per_token"] == 2 * 2 + 2
