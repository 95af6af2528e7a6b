"""R2/R3 replay on the ``hf`` engine, through the real router seam, with tests that cannot pass
vacuously: native routing is first made to differ from the routes replayed."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from replay_helpers import context, make_batch, make_engine, perturb_routers, replay_config  # noqa: E402
from rlcore.batch import PackedBatch  # noqa: E402
from rlcore.errors import BatchShapeError  # noqa: E402
from rlcore_replay.replay import R2_IDS, R2_NATIVE, Replayer, decode, encode  # noqa: E402


def run(engine, rep, ctx, record=True):
    """What the trainer does for one micro-batch."""
    req = rep.forward_request(ctx)
    rec = record or bool(req is not None and req.record_routes)
    out = engine.forward(ctx.batch, record_routes=rec, router=rep.router_hook, micro_batch=ctx)
    res = rep.postprocess(ctx, SimpleNamespace(engine=out))
    return out, res


def record(engine, batch):
    return engine.forward(batch, record_routes=True).routes


def with_routes(batch: PackedBatch, routes: torch.Tensor) -> PackedBatch:
    batch.fields["routes"] = routes.to(torch.int16)
    return batch


def logprobs(engine, batch, hidden):
    w = engine.head().weight
    lp = torch.log_softmax(hidden @ w.T, dim=-1)
    return lp.gather(1, batch.labels().clamp(min=0).unsqueeze(1)).squeeze(1)[batch.loss_mask]


def forced_forward(engine, batch, routes):
    """A reference forward forced to ``routes`` by hooks written here, independent of the seam:
    one sequence (router rows = packed rows), weights = softmax over all experts, renormalised."""
    assert batch.num_seqs == 1
    handles = []
    for pos, (_, mod) in enumerate(engine.seam.routers):
        def hook(m, args, out, pos=pos):
            logits = out[0]
            idx = routes[:, pos].long()
            w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            return logits, (w / w.sum(dim=-1, keepdim=True)).to(logits.dtype), idx
        handles.append(mod.register_forward_hook(hook))
    try:
        return engine.model.base_model(input_ids=batch.input_ids.view(1, -1), use_cache=False).last_hidden_state[0]
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_r3_replay_forces_recorded_experts_after_routers_change(arch):
    engine = make_engine(arch)
    batch = make_batch()
    recorded = record(engine, batch)
    perturb_routers(engine)
    native = record(engine, batch)
    assert not torch.equal(native, recorded), "the perturbation must change native routing"
    rep = Replayer(replay_config("R3"))
    ctx = context(with_routes(batch, recorded), rep.config)
    out, _ = run(engine, rep, ctx)
    assert torch.equal(out.routes, recorded), "the routers chose exactly the replayed experts"
    m = rep.step_end(SimpleNamespace(step=0, batch=batch))
    assert m["replay/coverage"] == 1.0 and m["replay/forwards"] == 1


def test_replayed_logprobs_equal_a_forward_forced_to_those_experts_and_differ_without():
    engine = make_engine()
    batch = make_batch(lens=(11,))
    recorded = record(engine, batch)
    perturb_routers(engine)
    rep = Replayer(replay_config("R3"))
    out, _ = run(engine, rep, context(with_routes(batch, recorded), rep.config))
    ref = forced_forward(engine, batch, recorded)
    native = engine.forward(batch).hidden
    lp, lp_ref, lp_native = (logprobs(engine, batch, h) for h in (out.hidden, ref, native))
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-6)
    assert (lp - lp_native).abs().max() > 1e-3, "without replay the log-probs differ"


def test_replay_on_unchanged_weights_reproduces_the_recorded_forward_bit_for_bit():
    engine = make_engine()
    batch = make_batch()
    base = engine.forward(batch, record_routes=True)
    rep = Replayer(replay_config("R3", agreement=True))
    out, _ = run(engine, rep, context(with_routes(batch, base.routes), rep.config))
    assert torch.equal(out.hidden, base.hidden)
    m = rep.step_end(SimpleNamespace(step=0, batch=batch))
    assert m["replay/agreement"] == 1.0 and m["replay/agreement/layer_0"] == 1.0


def test_gate_weights_come_from_current_scores_so_the_router_still_learns():
    engine = make_engine()
    batch = make_batch()
    recorded = record(engine, batch)
    perturb_routers(engine)
    rep = Replayer(replay_config("R3"))
    engine.train(True)
    out, _ = run(engine, rep, context(with_routes(batch, recorded), rep.config))
    out.hidden.pow(2).sum().backward()
    for layer, router in engine.seam.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, layer


def test_agreement_drops_when_native_routing_moves_away():
    engine = make_engine()
    batch = make_batch()
    recorded = record(engine, batch)
    perturb_routers(engine)
    rep = Replayer(replay_config("R3", agreement=True))
    run(engine, rep, context(with_routes(batch, recorded), rep.config))
    m = rep.step_end(SimpleNamespace(step=0, batch=batch))
    assert 0.0 <= m["replay/agreement"] < 1.0
    assert set(k for k in m if k.startswith("replay/agreement/layer_")) == {f"replay/agreement/layer_{i}" for i in range(3)}


def test_r2_records_in_old_logprob_compactly_and_replays_in_train():
    engine = make_engine()
    batch = make_batch()
    rep = Replayer(replay_config("R2"))
    old = context(batch, rep.config, phase="old_logprob")
    out, res = run(engine, rep, old, record=False)
    assert res.batch_updates[R2_IDS].dtype == torch.uint8 and res.batch_updates[R2_NATIVE].dtype == torch.bool
    for k, v in res.batch_updates.items():
        batch.write_back(batch, k, v)
    assert torch.equal(decode(batch.fields[R2_IDS], batch.fields[R2_NATIVE]), out.routes.long())
    perturb_routers(engine)
    out2, _ = run(engine, rep, context(batch, rep.config, phase="train"))
    assert torch.equal(out2.routes, out.routes)
    m = rep.step_end(SimpleNamespace(step=0, batch=batch))
    # 3 layers x top-2 uint8 + 3 mask bytes per token
    assert m["replay/bytes_per_token"] == 3 * 2 + 3
    assert m["replay/bytes_step"] == batch.num_tokens * 9


def test_r2_without_a_recording_is_an_error():
    engine = make_engine()
    batch = make_batch()
    rep = Replayer(replay_config("R2"))
    with pytest.raises(BatchShapeError, match="no routes recorded by the old-log-prob pass"):
        run(engine, rep, context(batch, rep.config, phase="train"))


def test_reference_pass_routes_natively():
    engine = make_engine()
    batch = make_batch()
    recorded = record(engine, batch)
    perturb_routers(engine)
    native = record(engine, batch)
    rep = Replayer(replay_config("R3"))
    out, _ = run(engine, rep, context(with_routes(batch, recorded), rep.config, phase="ref_logprob"))
    assert torch.equal(out.routes, native)


def test_compact_encoding_round_trips_and_picks_dtype():
    r = torch.tensor([[[0, 255], [-1, -1]], [[3, 1], [7, 2]]])
    ids, native = encode(r, 256)
    assert ids.dtype == torch.uint8 and native.tolist() == [[False, True], [False, False]]
    assert torch.equal(decode(ids, native), r)
    assert encode(torch.tensor([[[300, 1]]]), 512)[0].dtype == torch.int16


# ------------------------------------------------------------------------ never a silent no-op --


def test_missing_sample_routes_are_an_error_naming_the_sample_unless_native():
    engine = make_engine()
    batch = make_batch()
    recorded = record(engine, batch)
    with_routes(batch, recorded)
    batch.seq_fields["routes_present"] = torch.tensor([True, False, True])
    rep = Replayer(replay_config("R3"))
    with pytest.raises(BatchShapeError, match=r"no routed experts for sample\(s\) \[1\]"):
        run(engine, rep, context(batch, rep.config, phase="old_logprob"))
    rep = Replayer(replay_config("R3", on_missing="native"))
    s1 = slice(int(batch.layout.cu_seqlens_padded[1]), int(batch.layout.cu_seqlens_padded[2]))
    batch.fields["routes"][s1] = -1
    run(engine, rep, context(batch, rep.config, phase="old_logprob"))
    m = rep.step_end(SimpleNamespace(step=0, batch=batch))
    assert m["replay/missing_samples"] == 1.0
    assert m["replay/coverage"] == pytest.approx(1 - 5 / batch.num_tokens)


def test_route_tensor_with_more_layers_than_the_model_is_an_error():
    engine = make_engine(num_layers=2)
    batch = make_batch()
    recorded = record(engine, batch)
    wider = torch.cat([recorded, recorded[:, :1]], dim=1)  # a third routed layer the model lacks
    rep = Replayer(replay_config("R3"))
    with pytest.raises(BatchShapeError, match=r"routes of routed layer\(s\) \[2\] \(of 3\) were never consumed"):
        run(engine, rep, context(with_routes(batch, wider), rep.config))


def test_route_tensor_with_fewer_layers_than_the_model_is_an_error_naming_the_layer():
    engine = make_engine(num_layers=3)
    batch = make_batch()
    recorded = record(engine, batch)
    rep = Replayer(replay_config("R3"))
    with pytest.raises(BatchShapeError, match="router of layer 2 is routed layer 3 of the model, but the route "
                                              "tensor has 2 routed layers"):
        run(engine, rep, context(with_routes(batch, recorded[:, :2]), rep.config))


def test_duplicate_expert_and_out_of_range_ids_are_errors_naming_the_layer():
    engine = make_engine()
    batch = make_batch()
    bad = record(engine, batch).clone()
    bad[3, 1] = torch.tensor([4, 4])
    rep = Replayer(replay_config("R3"))
    with pytest.raises(BatchShapeError, match="layer 1 chose an expert twice"):
        run(engine, rep, context(with_routes(batch, bad), rep.config))
    bad[3, 1] = torch.tensor([4, 9])
    rep = Replayer(replay_config("R3"))
    with pytest.raises(BatchShapeError, match=r"layer 1 chose experts outside \[0, 8\)"):
        run(engine, rep, context(with_routes(batch, bad), rep.config))


def test_decoder_built_twice_is_an_error_naming_both_routers():
    engine = make_engine()
    stale = torch.nn.Module()
    stale.layers = copy.deepcopy(engine.model.model.layers)
    engine.model.model.stale = stale
    with pytest.raises(BatchShapeError, match=r"two MoE routers claim layer 0: 'model.layers.0.mlp.gate' and "
                                              r"'model.stale.layers.0.mlp.gate'"):
        type(engine)(engine.model, engine.tokenizer)


def test_router_that_never_runs_is_an_error_naming_it():
    engine = make_engine()
    batch = make_batch()
    recorded = record(engine, batch)
    moe = engine.model.model.layers[1].mlp
    moe.forward = lambda h: torch.zeros_like(h)  # the MoE block bypasses its router
    rep = Replayer(replay_config("R3"))
    with pytest.raises(BatchShapeError, match=r"MoE router of layer 1 \(model.layers.1.mlp.gate\) never ran"):
        run(engine, rep, context(with_routes(batch, recorded), rep.config))


def test_router_asked_twice_in_one_forward_is_an_error():
    engine = make_engine()
    batch = make_batch()
    recorded = record(engine, batch)
    rep = Replayer(replay_config("R3"))
    ctx = context(with_routes(batch, recorded), rep.config)
    rep.forward_request(ctx)
    gate = engine.model.model.layers[0].mlp.gate
    call_twice = engine.model.model.layers[0].mlp.forward

    def twice(h):
        gate(h.view(-1, h.shape[-1]))
        return call_twice(h)

    engine.model.model.layers[0].mlp.forward = twice
    with pytest.raises(BatchShapeError, match="router of layer 0 .routed index 0. was asked twice"):
        engine.forward(batch, router=rep.router_hook, micro_batch=ctx)


# ------------------------------------------------------------------------------ layout ---------


def test_mixed_dense_and_moe_layers_carry_rows_for_moe_layers_only():
    engine = make_engine(num_layers=4, mlp_only_layers=(0, 2))
    layout = engine.info.route_layout
    assert layout.layers == (1, 3)
    batch = make_batch()
    recorded = record(engine, batch)
    assert recorded.shape[1] == 2
    perturb_routers(engine)
    # what a rollout engine reports: every decoder layer (dense ones with junk), selected down
    full = torch.full((recorded.shape[0], 4, 2), 5, dtype=torch.int16)
    full[:, 0, 1] = 6
    full[:, 2, 1] = 6
    full[:, [1, 3]] = recorded
    sel = layout.select(full)
    rep = Replayer(replay_config("R3"))
    out, _ = run(engine, rep, context(with_routes(batch, sel), rep.config))
    assert torch.equal(out.routes, recorded)


# ----------------------------------------------------------------------- recomputation ---------


def _checkpointed(engine):
    if hasattr(engine.model, "activation_checkpointing_enable"):
        engine.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        engine.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine.train(True)
    return engine


def test_replay_is_identical_under_activation_recomputation():
    engine = make_engine()
    batch = make_batch()
    recorded = record(engine, batch)
    perturb_routers(engine)
    plain = copy.deepcopy(engine.model)
    _checkpointed(engine)
    rep = Replayer(replay_config("R3"))
    out, _ = run(engine, rep, context(with_routes(batch, recorded), rep.config))
    out.hidden.pow(2).sum().backward()
    m = rep.step_end(SimpleNamespace(step=0, batch=batch))
    assert m["replay/recomputed_forwards"] == 1.0, "the routers ran again in backward and were replayed"
    # the same gradients as without recomputation
    ref = type(engine)(plain, engine.tokenizer)
    ref.train(True)
    rep2 = Replayer(replay_config("R3"))
    out2, _ = run(ref, rep2, context(with_routes(batch, recorded), rep2.config))
    out2.hidden.pow(2).sum().backward()
    for (n, p), (_, q) in zip(engine.model.named_parameters(), ref.model.named_parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_recomputation_with_other_experts_is_an_error():
    engine = _checkpointed(make_engine())
    batch = make_batch()
    with torch.no_grad():
        recorded = record(engine, batch)
    rep = Replayer(replay_config("R3"))
    ctx = context(with_routes(batch, recorded), rep.config)
    out, _ = run(engine, rep, ctx)
    real = rep.router_hook

    def lying(call):
        d = real(call)
        if call.recompute and d is not None:
            d.indices = d.indices.flip(-1).roll(1, dims=0)
        return d

    engine.seam.last.dispatch = lying
    with pytest.raises(BatchShapeError, match="got other experts under activation recomputation"):
        out.hidden.pow(2).sum().backward()
