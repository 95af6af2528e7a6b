"""The megatron engine on CPU against megatron-core (0.12.1 and 0.16.1 in CI): conformance,
log-probs against transformers/the hf engine, HF ↔ Megatron round trips, the router seam,
MTP, and the trainer end to end."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from rlcore.batch import PackedBatch
from rlcore.errors import BatchShapeError, ConfigError, RLCoreError
from rlcore.heads import reference_logprobs
from rlcore.testing.conformance import PROMPTS, EngineConformance
from rlcore.types import HeadInput, RouterDecision

pytestmark = pytest.mark.engine("megatron")

ROOT = Path(__file__).resolve().parents[3]
SEQS = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2]]


def _logprobs(engine, batch, **kw):
    out = engine.forward(batch, **kw)
    hw = engine.head()
    head = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels(), vocab=hw.vocab,
                                        loss_mask=batch.loss_mask))
    return out, head.logprobs


class TestMegatronEngineConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        from rlcore_megatron.engine import HFSource, MegatronEngine

        return lambda model_dir: MegatronEngine(HFSource.from_dir(model_dir))


# ------------------------------------------------------------------ log-probs ---------------


def _hf_engine(path: Path):
    """The hf engine on ``path``; for a non-Qwen2 model with MTP layers (DeepSeek-V3 layout, which
    the hf engine does not build) the trunk alone, through transformers' own class."""
    from rlcore.testing.models import HFEngine

    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("num_nextn_predict_layers") and cfg.get("model_type") != "qwen2":
        from rlcore.testing.models import hf_model
        from transformers import AutoTokenizer

        return HFEngine(hf_model(path), AutoTokenizer.from_pretrained(str(path)))
    return HFEngine.from_pretrained(path)


@pytest.mark.parametrize("model", ["dense_a", "dense_tied", "moe_a", "moe_mtp", "dense_mtp"])
def test_logprobs_equal_hf_engine_fp32(engine_for, megatron_dirs, figures, model):
    hf = _hf_engine(megatron_dirs[model])
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        _, ours = _logprobs(engine_for(model), batch)
        _, theirs = _logprobs(hf, batch)
    diff = float((ours - theirs).abs().max())
    figures(f"max |logprob(megatron) - logprob(hf)| fp32, {model}", f"{diff:.2e}")
    assert ours.dtype == torch.float32 and bool((ours[batch.loss_mask] < 0).all())
    assert diff < 1e-5


def test_qwen2_moe_shared_expert_gate(engine_for, megatron_dirs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "moe_shared_expert_gate" not in TransformerConfig.__dataclass_fields__:
        with pytest.raises(ConfigError, match="moe_shared_expert_gate"):
            engine_for("qwen2_moe")
        return
    from rlcore.testing.models import HFEngine

    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        _, ours = _logprobs(engine_for("qwen2_moe"), batch)
        _, theirs = _logprobs(HFEngine.from_pretrained(megatron_dirs["qwen2_moe"]), batch)
    assert float((ours - theirs).abs().max()) < 1e-5


# ------------------------------------------------------------------ weights ------------------


@pytest.mark.parametrize("model", ["dense_a", "dense_tied", "moe_a", "moe_mtp", "dense_mtp"])
def test_hf_megatron_hf_round_trip_is_bit_exact(engine_for, megatron_dirs, tmp_path, figures, model):
    from safetensors.torch import load_file

    src = {}
    for f in sorted(megatron_dirs[model].glob("*.safetensors")):
        src.update(load_file(str(f)))
    engine = engine_for(model)
    engine.save_hf(tmp_path / "out")
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(src)
    assert all(torch.equal(back[n], src[n]) for n in src)
    exported = dict(engine.export_hf_weights())
    assert set(exported) == set(src) and all(torch.equal(exported[n], src[n]) for n in src)
    cfg_in = json.loads((megatron_dirs[model] / "config.json").read_text())
    cfg_out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg_out["model_type"] == cfg_in["model_type"] and cfg_out["vocab_size"] == cfg_in["vocab_size"]
    figures(f"HF -> Megatron -> HF round trip, {model}", f"{len(src)} tensors bit-exact")


def test_vocab_padding_rows_are_excluded(engine_for):
    engine = engine_for("dense_a")
    hw = engine.head()
    assert hw.weight.shape[0] == engine.padded_vocab > engine.info.vocab_size
    assert hw.vocab.vocab_size == engine.info.vocab_size and hw.vocab.rows == engine.padded_vocab
    assert torch.all(hw.weight[engine.info.vocab_size:] == 0)


def test_state_dict_and_reference_copy(engine_for):
    engine = engine_for("moe_a")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    ref = engine.make_reference()
    assert all(not p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        _, a = _logprobs(engine, batch)
        _, b = _logprobs(ref, batch)
    assert torch.equal(a, b)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01)
    ref.load_state_dict(engine.state_dict())
    with torch.no_grad():
        _, c = _logprobs(ref, batch)
    assert torch.equal(a, c)


# ------------------------------------------------------------------ router seam --------------


def test_router_seam_mode_follows_megatron_signature(engine_for):
    import megatron.core.transformer.moe.moe_utils as moe_utils

    engine = engine_for("moe_a")
    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    native = fn is not None and "router_replay" in inspect.signature(fn).parameters
    assert engine.seam.mode == ("native" if native else "intercept")
    if native:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        replays = [site.router.router_replay for site in engine.seam.sites]
        assert all(r.site is site for r, site in zip(replays, engine.seam.sites, strict=True))
        assert not any(r is g for r in replays for g in RouterReplay.global_router_replay_instances)
    assert not getattr(engine.config, "moe_router_fusion", False)


def test_routes_with_mtp_have_the_documented_layout_and_replay_exactly(engine_for, figures):
    engine = engine_for("moe_mtp")
    layout = engine.info.route_layout
    assert layout.layers == (0, 1, 2) and layout.num_hidden_layers == 2  # decoder MoE layers, then MTP
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        out, lp = _logprobs(engine, batch, record_routes=True, mtp_hidden=True)
        no_mtp, _ = _logprobs(engine, batch, record_routes=True)
    routes = out.routes
    assert routes.dtype == torch.int16 and tuple(routes.shape) == (batch.num_tokens, 3, 2)
    assert bool((routes >= 0).all()) and bool((routes < layout.num_experts).all())
    assert torch.equal(no_mtp.routes[:, :2], routes[:, :2]) and bool((no_mtp.routes[:, 2] == -1).all())

    calls = []

    def replay(call):
        calls.append((call.layer, call.routed_index, call.is_mtp, call.scores.shape))
        return RouterDecision(indices=routes[:, call.routed_index].long())

    with torch.no_grad():
        out2, lp2 = _logprobs(engine, batch, router=replay, record_routes=True, mtp_hidden=True)
    assert [c[:3] for c in calls] == [(0, 0, False), (1, 1, False), (2, 2, True)]
    assert all(tuple(c[3]) == (batch.num_tokens, layout.num_experts) for c in calls)
    assert torch.equal(out2.routes, routes)
    assert torch.equal(lp2, lp) and all(torch.equal(a, b) for a, b in zip(out.mtp_hidden, out2.mtp_hidden, strict=True))
    figures("record -> replay (MoE + MTP, dropout off)", "routes, log-probs and MTP hidden states bit-identical")


def test_negative_rows_route_natively_and_bad_decisions_are_refused(engine_for):
    engine = engine_for("moe_a")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        native, lp = _logprobs(engine, batch, record_routes=True)
        none = torch.full((batch.num_tokens, 2), -1, dtype=torch.long)
        out, lp2 = _logprobs(engine, batch, router=lambda c: RouterDecision(indices=none), record_routes=True)
        assert torch.equal(out.routes, native.routes) and torch.equal(lp2, lp)
        twice = torch.zeros((batch.num_tokens, 2), dtype=torch.long)
        with pytest.raises(BatchShapeError, match="twice"):
            engine.forward(batch, router=lambda c: RouterDecision(indices=twice))
        with pytest.raises(BatchShapeError, match="num_tokens"):
            engine.forward(batch, router=lambda c: RouterDecision(indices=twice[:3]))
        with pytest.raises(BatchShapeError, match="outside"):
            engine.forward(batch, router=lambda c: RouterDecision(indices=twice + torch.tensor([8, 9])))


def test_fused_router_is_refused_while_the_seam_is_active(engine_for):
    engine = engine_for("moe_a")
    if not hasattr(engine.config, "moe_router_fusion"):
        pytest.skip("this megatron-core has no fused router (moe_router_fusion appeared in 0.14)")
    engine.config.moe_router_fusion = True
    try:
        with pytest.raises(RLCoreError, match="moe_router_fusion"):
            engine.forward(PackedBatch.pack(SEQS, [1, 1, 2]))
    finally:
        engine.config.moe_router_fusion = False


# ------------------------------------------------------------------ MTP ----------------------


def test_mtp_layer_matches_megatrons_own_mtp_layer(engine_for):
    """Our MTP forward against megatron's MultiTokenPredictionLayer.forward, on one sequence
    (megatron's own shift is a plain roll, right for a single unpadded sequence)."""
    from rlcore_megatron import compat

    engine = engine_for("moe_mtp")
    seq = [3, 4, 5, 13, 7, 7, 2]
    batch = PackedBatch.pack([seq], [1])
    captured = {}
    handle = engine.model.decoder.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    with torch.no_grad():
        out = engine.forward(batch, mtp_hidden=True)
    handle.remove()
    layer = engine.mtp.layers[0]
    ids = torch.tensor([seq])
    pos = torch.arange(len(seq))[None]
    kw = dict(hidden_states=out.hidden[:, None], attention_mask=captured["attention_mask"],
              rotary_pos_emb=captured["rotary_pos_emb"])
    with torch.no_grad():
        if compat.accepts(type(layer).forward, "decoder_input"):  # 0.12/0.13: the block rolls and embeds
            rolled = torch.roll(ids, -1, dims=-1)
            theirs = layer(decoder_input=engine.model.embedding(input_ids=rolled, position_ids=pos), **kw)
        else:
            theirs = layer(input_ids=ids, position_ids=pos, embedding=engine.model.embedding, **kw)
    if isinstance(theirs, tuple):
        theirs = theirs[0]
    torch.testing.assert_close(out.mtp_hidden[0][:-1], theirs[:-1, 0], atol=1e-6, rtol=0)


def test_mtp_shift_never_crosses_a_sequence_boundary(engine_for):
    engine = engine_for("moe_mtp")
    packed = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        together = engine.forward(packed, mtp_hidden=True).mtp_hidden[0]
        alone = [engine.forward(PackedBatch.pack([s], [1]), mtp_hidden=True).mtp_hidden[0] for s in SEQS]
    for got, ref in zip(packed.unpack(together), alone, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_mtp_requested_from_a_model_without_mtp_names_the_field(engine_for):
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        engine_for("dense_a").forward(PackedBatch.pack(PROMPTS, [1] * 3), mtp_hidden=True)


def test_mtp_weights_can_be_left_out_of_the_export(engine_for):
    engine = engine_for("moe_mtp")
    engine.settings.export_mtp = False
    try:
        names = [n for n, _ in engine.export_hf_weights()]
    finally:
        engine.settings.export_mtp = True
    assert names and not any(n.startswith(("model.layers.2.", "model.mtp_layers.")) for n in names)
    assert "model.layers.2.eh_proj.weight" in [n for n, _ in engine.export_hf_weights()]  # DeepSeek layout


# ------------------------------------------------------------------ training -----------------


@pytest.mark.slow
def test_rlcore_train_tiny_grpo_reward_rises(tmp_path, figures):
    from rlcore.testing.runs import main

    out = tmp_path / "run"
    # the example's 150 steps: RL trajectories are chaotic (the hf engine on the same weights
    # computes the same gradients to ~1e-6, yet samples flip), so the bar is the finished run
    assert main(["train", str(ROOT / "examples" / "megatron_tiny.yaml"), "--output", str(out), "training.steps=150",
                 "output.checkpoint_every=0", "output.plot=false", "output.tensorboard=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(150))
    start = sum(r["reward_mean"] for r in rows[:5]) / 5
    end = sum(r["reward_mean"] for r in rows[-10:]) / 10
    figures("rlcore train examples/megatron_tiny.yaml, 150 steps: reward first 5 -> last 10",
            f"{start:.3f} -> {end:.3f} (wall {rows[-1]['wall_seconds']:.0f} s)")
    assert start < 0.3 and end >= 0.8 and end > start + 0.4
    assert all(r["sync_verified"] for r in rows)
    assert max(r["logprob_mismatch_max"] for r in rows) < 1e-4, "megatron trainer and HF rollout agree (fp32)"


def test_hf_config_megatron_cannot_express_is_a_config_error_not_megatrons_assertion(tmp_path):
    """Qwen3-MoE with one expert per token and norm_topk_prob=true: before, megatron-core's
    TransformerConfig raised a bare ValueError ("Please use --moe-router-pre-softmax when topk
    is 1"); now the engine refuses it naming the HF fields, before megatron is asked."""
    from rlcore.testing.models import make_model_dir
    from rlcore_megatron.engine import HFSource, MegatronEngine

    d = make_model_dir(tmp_path / "top1", "qwen3_moe", seed=11, topk=1)
    with pytest.raises(ConfigError, match="num_experts_per_tok=1 with norm_topk_prob=true") as e:
        MegatronEngine(HFSource.from_dir(d))
    assert e.value.key == "engine.model"


def test_every_argument_rlcore_passes_megatron_builders_is_accepted_or_droppable(engine_for):
    """On the installed megatron-core, building the models above dropped nothing that shapes the
    model: replay the builders' calls and check each argument against their signatures."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
    from rlcore_megatron import compat

    passed = {
        GPTModel: ["config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process",
                   "post_process", "parallel_output", "share_embeddings_and_output_weights",
                   "position_embedding_type", "rotary_percent", "rotary_base"],
        specs.get_gpt_decoder_block_spec: ["config", "use_transformer_engine"],
        specs.get_gpt_mtp_block_spec: ["config", "spec", "use_transformer_engine"],
        MultiTokenPredictionBlock: ["config", "spec", "pg_collection"],
    }
    for fn, names in passed.items():
        params = inspect.signature(fn).parameters
        missing = [n for n in names if n not in params and n not in compat.DROPPABLE_KWARGS]
        assert not missing, f"{fn.__qualname__} lacks {missing}"
    assert engine_for("moe_mtp").mtp is not None  # built through call_with_supported on this version
