"""The ``mtp`` plugin: config validation, labels rolled inside packed sequences, which parameters
the MTP loss reaches under each detach setting, the per-depth metrics, the loss going through the
run's selected forward_fn (``fused`` under ``plugins: [fused, mtp]``), and a short GRPO run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from rlcore import errors
from rlcore.batch import PackedBatch
from rlcore.engines import mimo_layout
from rlcore.engines.tiny import make_tiny_model, make_tokenizer
from rlcore.heads import ReferenceHead
from rlcore.stack import load_stack
from rlcore.testing.models import HFEngine, TinyModelConfig
from rlcore.types import HeadInput, ModelOutput
from rlcore_mtp.loss import argmax_hits, depth_targets, mtp_postprocess
from rlcore_mtp.plugin import MTPSettings

ROOT = Path(__file__).resolve().parents[3]
TINY_MTP = str(ROOT / "examples" / "tiny_mtp.yaml")
WORDS = [str(i) for i in range(10)]
SMALL_MODEL = ["engine.model.tiny.hidden_size=32", "engine.model.tiny.head_dim=16",
               "engine.model.tiny.intermediate_size=48"]
SMALL_RUN = ["rollout.n=2", "data.prompts_per_step=2", "output.plot=false", "output.tensorboard=false",
             "output.progress=false", "rollout.max_new_tokens=3", *SMALL_MODEL]


# ------------------------------------------------------------------------ config -------------


def test_example_config_resolves_with_defaults():
    s = load_stack(TINY_MTP)
    assert "mtp" in s.plugins.active
    m = s.config.mtp
    assert (m.loss_scale, m.detach_trunk, m.detach_head, m.depths) == (0.1, True, True, 0)


@pytest.mark.parametrize("override, key", [
    ("mtp.loss_scale=-0.5", "mtp.loss_scale"),
    ("mtp.depths=-1", "mtp.depths"),
    ("mtp.depths=3", "mtp.depths"),  # the tiny model has 2 MTP layers
])
def test_bad_settings_name_the_field(override, key):
    with pytest.raises(errors.ConfigError) as e:
        load_stack(TINY_MTP, [override])
    assert key in str(e.value)


def test_bad_type_names_the_field():
    with pytest.raises(errors.ConfigError, match="mtp.detach_trunk"):
        load_stack(TINY_MTP, ["mtp.detach_trunk=sometimes"])


def test_a_model_without_mtp_layers_is_refused_before_anything_is_built():
    with pytest.raises(errors.MissingCapabilityError, match="no MTP layers: set engine.model.tiny.mtp_layers >= 1"):
        load_stack(TINY_MTP, ["engine.model.tiny.mtp_layers=0", "mtp.depths=0"])
    # MTP layers over a MoE arch: hf's MTP layers are MiMo's, over qwen2 (its 'mtp' gap; and core asks
    # for an engine declaring 'moe_mtp', which builds its own)
    with pytest.raises(errors.MissingCapabilityError, match=r"engine\.model\.tiny\.mtp_layers.*'qwen3_moe'"):
        load_stack(TINY_MTP, ["engine.model.tiny.arch=qwen3_moe"])


# ------------------------------------------------------------------------ labels -------------


def test_depth_labels_stay_inside_each_sequence_and_follow_the_loss_mask():
    seqs = [[3, 4, 5, 6, 7, 8], [9, 3, 4], [5, 6, 7, 8, 9]]
    batch = PackedBatch.pack(seqs, [2, 1, 3])
    tokens = [(s, i) for s, seq in enumerate(seqs) for i in range(len(seq))]
    for d in (1, 2, 3):
        labels, mask = depth_targets(batch, d)
        for t, (s, i) in enumerate(tokens):
            seq = seqs[s]
            j = i + d + 1  # the token depth d predicts at position i
            response = j < len(seq) and j >= [2, 1, 3][s]
            assert bool(mask[t]) == response, (d, s, i)
            if response:
                assert int(labels[t]) == seq[j]


# ------------------------------------------------------------------------ gradients ----------


def _setup(seed=0):
    tok = make_tokenizer(WORDS)
    cfg = TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=48, mtp_layers=2, seed=seed)
    engine = HFEngine(make_tiny_model(cfg, tok), tok)
    batch = PackedBatch.pack([[3, 4, 5, 6, 7, 8, 9], [8, 9, 3, 4, 5]], [2, 1])
    return engine, batch


def _ctx(batch, settings):
    config = OmegaConf.create({"mtp": settings})
    return SimpleNamespace(phase="train", batch=batch, config=config, num_tokens_in_step=batch.num_loss_tokens)


def _run(engine, batch, settings, forward_fn=None):
    forward_fn = forward_fn or ReferenceHead()
    out = engine.forward(batch, mtp_hidden=True, mtp_detach_trunk=settings["detach_trunk"])
    hw = engine.head()
    head = forward_fn(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels(), vocab=hw.vocab,
                                loss_mask=batch.loss_mask, compute_entropy=False))
    return mtp_postprocess(_ctx(batch, settings), ModelOutput(out, head, hw, forward_fn), OmegaConf.create(settings))


@pytest.mark.parametrize("detach_trunk", [True, False])
@pytest.mark.parametrize("detach_head", [True, False])
def test_which_parameters_receive_mtp_gradients(detach_trunk, detach_head):
    engine, batch = _setup()
    settings = dict(MTPSettings().__dict__, detach_trunk=detach_trunk, detach_head=detach_head)
    res = _run(engine, batch, settings)
    res.loss_terms["mtp"].backward()
    got = {n for n, p in engine.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    mtp = set(mimo_layout.tensor_names(2))
    assert mtp <= got  # the MTP layers always learn
    assert ("lm_head.weight" in got) == (not detach_head)
    trunk = got - mtp - {"lm_head.weight"}
    if detach_trunk:
        assert trunk == set()
    else:
        assert {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                "model.layers.1.self_attn.q_proj.weight"} <= trunk
    assert "model.norm.weight" not in got  # neither depth reads the trunk's final norm


def test_loss_and_metrics_match_an_explicit_computation():
    engine, batch = _setup(seed=1)
    settings = dict(MTPSettings().__dict__, loss_scale=0.3)
    res = _run(engine, batch, settings)
    out = engine.forward(batch, mtp_hidden=True)
    w = engine.head().weight.detach()
    total = 0.0
    for d in (1, 2):
        labels, mask = depth_targets(batch, d)
        logits = out.mtp_hidden[d - 1].detach() @ w.T
        ce = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum")
        total += float(ce)
        assert res.metrics[f"mtp/loss_d{d}"] == pytest.approx(float(ce) / int(mask.sum()), rel=1e-5)
        acc = float((logits[mask].argmax(1) == labels[mask]).float().mean())
        assert res.metrics[f"mtp/acceptance_d{d}"] == pytest.approx(acc)
    expect = 0.3 / 2 * total / batch.num_loss_tokens
    assert float(res.loss_terms["mtp"].detach()) == pytest.approx(expect, rel=1e-5)


def test_argmax_hits_counts_ties_and_masks():
    from rlcore.types import VocabShard

    w = torch.eye(4)
    h = torch.tensor([[0.0, 2.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    labels = torch.tensor([1, 0, 2])
    hits = argmax_hits(h, w, labels, torch.tensor([True, True, True]), VocabShard.full(4))
    assert hits.tolist() == [True, True, False]
    hits = argmax_hits(h, w, labels, torch.tensor([False, True, True]), VocabShard.full(4))
    assert hits.tolist() == [False, True, False]


def test_missing_mtp_hidden_is_an_error_not_a_skip():
    engine, batch = _setup()
    out = engine.forward(batch)  # no mtp_hidden
    hw = engine.head()
    head = ReferenceHead()(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels(), vocab=hw.vocab))
    with pytest.raises(errors.RLCoreError, match="no MTP hidden states"):
        mtp_postprocess(_ctx(batch, MTPSettings().__dict__), ModelOutput(out, head, hw, ReferenceHead()),
                        OmegaConf.create(MTPSettings().__dict__))


# ------------------------------------------------------------------------ runs ---------------


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_fused_and_mtp_put_the_mtp_loss_through_the_fused_head(tmp_path, monkeypatch):
    pytest.importorskip("rlcore_fused")
    from rlcore.testing.runs import Trainer
    from rlcore_fused.head import FusedHead

    calls: list[tuple[str, int, bool]] = []
    real = FusedHead.__call__

    def spy(self, inp):
        calls.append(("mtp" if inp.temperature == 1.0 and not inp.compute_entropy and inp.loss is None else "policy",
                      int(inp.hidden.shape[0]), inp.weight.requires_grad))
        return real(self, inp)

    def no_reference(self, inp):
        raise AssertionError("the reference head was called although forward.name is fused")

    monkeypatch.setattr(FusedHead, "__call__", spy)
    monkeypatch.setattr(ReferenceHead, "__call__", no_reference)
    stack = load_stack(TINY_MTP, ["plugins=[fused,mtp]", "forward.name=fused", "training.steps=1",
                                  "rollout.temperature=0.7", f"output.dir={tmp_path / 'run'}", *SMALL_RUN])
    Trainer(stack).run()
    mtp_calls = [c for c in calls if c[0] == "mtp"]
    assert len(mtp_calls) >= 2 and len(mtp_calls) % 2 == 0  # two depths per train micro-batch
    assert not any(c[2] for c in mtp_calls)  # detach_head: the fused head got a detached weight
    row = _rows(tmp_path / "run")[-1]
    assert row["mtp/loss_d1"] > 0 and row["mtp/loss_d2"] > 0 and "loss/mtp/mtp" in row


def test_short_grpo_run_logs_mtp_loss_and_acceptance_per_depth(tmp_path):
    """``examples/tiny_mtp.yaml`` for 2 steps, the local rollout drafting with both MTP depths."""
    from rlcore.testing.runs import main

    out = tmp_path / "run"
    assert main(["train", TINY_MTP, "-o", str(out), "training.steps=2", "rollout.draft_depths=2", *SMALL_RUN]) == 0
    rows = _rows(out)
    assert len(rows) == 2
    for row in rows:
        for d in (1, 2):
            assert 0 < row[f"mtp/loss_d{d}"] < 10 and 0 <= row[f"mtp/acceptance_d{d}"] <= 1
            assert 0 <= row[f"rollout/acceptance_d{d}"] <= 1
        assert row["loss/mtp/mtp"] > 0
        assert row["rollout/draft_weight_version"] == row["weight_version"]
        assert row["rollout/kv_cache_freed_bytes"] == 0 and row["rollout/kv_cache_peak_bytes"] > 0
    saved = json.loads((out / "policy_hf" / "config.json").read_text())
    assert saved["architectures"] == ["MiMoForCausalLM"] and saved["num_nextn_predict_layers"] == 2
