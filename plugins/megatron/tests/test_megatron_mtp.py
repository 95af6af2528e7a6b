"""MTP on the megatron engine, per megatron-core version (0.12.1 and 0.16.1 on CPU here; 0.19 on
the GPU machine through plugins/megatron/bench/gpu_mtp.py, which runs these same checks):

* megatron-core's own MTP loss is never added: rlcore's MTP loss is the only gradient the MTP
  layers get (spies on every place megatron computes or attaches its MTP loss, a walk of the
  autograd graph, and the gradient compared with the one of rlcore's loss alone); a control run
  of megatron's native path on the same version shows the test would see a second loss;
* ``detach_trunk`` / ``detach_head``: which parameters receive MTP gradients in each setting.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rlcore.batch import PackedBatch
from rlcore_megatron.mtp_checks import (
    MegatronMTPSpies,
    autograd_node_names,
    mtp_gradient_owners,
    mtp_loss_exactly_once,
    native_mtp_loss_control,
)

pytestmark = pytest.mark.engine("megatron")

SEQS = [[3, 4, 5, 13, 6, 2, 9], [7, 7, 13, 4], [10, 9, 8, 7, 6, 13, 2]]


@pytest.fixture
def fresh(megatron_dirs):
    """A MegatronEngine of its own (gradients are written into it)."""
    from rlcore_megatron.engine import HFSource, MegatronEngine

    return lambda name: MegatronEngine(HFSource.from_dir(megatron_dirs[name]))


def test_graph_walk_and_spies_see_megatrons_mtp_loss_when_it_is_there():
    """The instruments the next tests rely on are live: an ``MTPLossAutoScaler`` applied by hand
    is seen by the spy and found in the autograd graph."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    x = torch.ones(3, requires_grad=True)
    with MegatronMTPSpies() as spies:
        y = MTPLossAutoScaler.apply(x * 2, (x ** 2).sum())
        assert "MTPLossAutoScalerBackward" in autograd_node_names(y.sum())
        y.sum().backward()
    assert spies.calls["MTPLossAutoScaler.forward"] == 1 and spies.calls["MTPLossAutoScaler.backward"] == 1


@pytest.mark.parametrize("model", ["moe_mtp", "dense_mtp"])
def test_megatron_mtp_loss_is_added_exactly_once(fresh, figures, model):
    """rlcore's MTP loss is the only MTP loss in the graph, on this megatron-core version
    (MoE + MTP in DeepSeek-V3's layout, dense + MTP in MiMo's)."""
    engine = fresh(model)
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    report = mtp_loss_exactly_once(engine, batch)
    assert report["megatron_calls"] == {}, report["megatron_calls"]
    assert not report["autoscaler_in_graph"]
    assert report["mtp_params_with_grad"] > 0 and report["max_abs_mtp_grad"] > 0
    # the MTP layers' gradient from the whole step == the gradient of rlcore's MTP loss alone
    assert report["max_abs_grad_diff_vs_rlcore_alone"] == 0.0
    figures(f"MTP loss terms in the graph (rlcore path, {model})", "1 (rlcore's); megatron's loss code called 0 times")


def test_megatrons_native_mtp_path_would_add_a_second_loss(fresh, figures):
    """Control: megatron-core's native MTP loss path on this version (0.12/0.13: the block's
    forward with labels; 0.14+: ``GPTModel._postprocess``; 0.19: with ``labels=None``, which
    derives labels from ``input_ids``) attaches its loss to the main hidden states, and the MTP
    layers' gradient then differs from rlcore's loss alone — what the test above would catch."""
    engine = fresh("moe_mtp")
    control = native_mtp_loss_control(engine, [3, 4, 5, 13, 6, 2, 9, 8])
    assert control["autoscaler_in_graph"]
    assert control["megatron_calls"].get("MTPLossAutoScaler.forward", 0) >= 1
    assert control["megatron_calls"].get("MTPLossAutoScaler.backward", 0) >= 1
    assert control["max_abs_grad_diff_vs_rlcore_alone"] > 1e-6
    figures(f"native MTP path ({control['path']}) adds megatron's loss",
            f"max |grad diff| on MTP params {control['max_abs_grad_diff_vs_rlcore_alone']:.2e}")


@pytest.mark.parametrize("model", ["moe_mtp", "dense_mtp"])
@pytest.mark.parametrize("detach_trunk,detach_head", [(False, False), (True, False), (False, True), (True, True)])
def test_which_parameters_receive_mtp_gradients(engine_for, figures, model, detach_trunk, detach_head):
    engine = engine_for(model)  # the helper clears the gradients it writes
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    owners, mtp_grads = mtp_gradient_owners(engine, batch, detach_trunk=detach_trunk, detach_head=detach_head)
    assert owners["mtp"], "the MTP layers get the MTP loss's gradient in every setting"
    assert bool(owners["trunk"]) is not detach_trunk, owners["trunk"][:3]
    assert bool(owners["embedding"]) is not detach_trunk
    assert bool(owners["head"]) is not detach_head
    # MiMo's depth 1 reads the trunk before its final norm, megatron's (DeepSeek layout) after it
    reads_final_norm = "decoder.final_layernorm.weight" in owners["trunk"]
    assert reads_final_norm is (model == "moe_mtp" and not detach_trunk)
    # detaching prunes the graph only: the MTP layers' own gradient is the same in every setting
    engine.zero_grad()
    _, reference = mtp_gradient_owners(engine, batch, detach_trunk=False, detach_head=False)
    for name, g in mtp_grads.items():
        torch.testing.assert_close(g, reference[name], atol=0, rtol=0)
    figures(f"MTP gradients reach ({model}, detach_trunk={detach_trunk}, detach_head={detach_head})",
            ", ".join(f"{k}: {len(v)}" for k, v in owners.items()))


def test_native_mtp_loss_is_unreachable(fresh):
    """The GPTModel has no MTP of its own (its forward cannot add megatron's loss on any
    version), and the MTP block's forward — megatron's loss on 0.12/0.13 — refuses to run."""
    from rlcore.errors import RLCoreError
    from rlcore_megatron import compat

    engine = fresh("moe_mtp")
    assert not getattr(engine.model.config, "mtp_num_layers", None)
    assert not isinstance(getattr(engine.model, "mtp", None), torch.nn.Module)
    with pytest.raises(RLCoreError, match="megatron-core's own MTP loss"):
        engine.mtp(hidden_states=None)
    engine.model.config.mtp_num_layers = 1
    try:
        with pytest.raises(RLCoreError, match="would add megatron-core's own MTP loss"):
            compat.refuse_native_mtp_loss(engine.model, None)
    finally:
        engine.model.config.mtp_num_layers = None


# ------------------------------------------------------------------ MiMo layout -------------


def test_mimo_export_names_and_config(engine_for, tmp_path):
    """A Qwen2 + MTP model exports its MTP layers under MiMo's names, with the config vLLM keys
    its MiMo model and MTP draft on; a Qwen3-MoE + MTP model keeps DeepSeek-V3's layout."""
    engine = engine_for("dense_mtp")
    assert engine.names.mtp_layout == "mimo"
    names = [n for n, _ in engine.export_hf_weights()]
    mtp = sorted(n for n in names if n.startswith("model.mtp_layers."))
    assert {"model.mtp_layers.0.token_layernorm.weight", "model.mtp_layers.0.hidden_layernorm.weight",
            "model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.final_layernorm.weight",
            "model.mtp_layers.0.self_attn.q_proj.weight", "model.mtp_layers.0.mlp.down_proj.weight"} <= set(mtp)
    assert not any(".mtp_block." in n or n.startswith(f"model.layers.{engine.spec.num_layers}.") for n in names)
    engine.save_hf(tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["model_type"] == "qwen2"
    assert engine_for("moe_mtp").names.mtp_layout == "deepseek"


def test_mimo_input_proj_is_eh_proj_with_its_halves_swapped(engine_for, megatron_dirs):
    """megatron's ``eh_proj`` multiplies ``[enorm(e), hnorm(h)]``, MiMo's ``input_proj``
    ``[hidden_layernorm(h), token_layernorm(e)]``: the same linear map, columns swapped."""
    from safetensors.torch import load_file

    engine = engine_for("dense_mtp")
    theirs = load_file(str(megatron_dirs["dense_mtp"] / "model.safetensors"))["model.mtp_layers.0.input_proj.weight"]
    ours = dict(engine.named_parameters())["mtp.layers.0.eh_proj.weight"].detach()
    H = engine.spec.hidden_size
    e, h = torch.randn(5, H), torch.randn(5, H)
    torch.testing.assert_close(torch.cat([e, h], -1) @ ours.T, torch.cat([h, e], -1) @ theirs.T)
    assert not torch.equal(ours, theirs)


def test_mimo_semantics_zero_the_first_positions_token_embedding(engine_for):
    """MiMo's MTP layer does not read the token embedding at a sequence's first position (vLLM
    zeroes it), so depth 1 at position 0 cannot depend on token 1 (the trunk at position 0 does
    not see it either); in DeepSeek-V3's layout megatron's semantics do read it. The mask also
    drops positions whose token ``t + d`` does not exist."""
    from rlcore_megatron.layout import make_layout

    for model, reads_it in (("dense_mtp", False), ("moe_mtp", True)):
        engine = engine_for(model)
        a, b = [3, 4, 5, 13, 6, 2], [3, 9, 5, 13, 6, 2]
        with torch.no_grad():
            ha = engine.forward(PackedBatch.pack([a], [1]), mtp_hidden=True).mtp_hidden[0]
            hb = engine.forward(PackedBatch.pack([b], [1]), mtp_hidden=True).mtp_hidden[0]
        assert torch.equal(ha[0], hb[0]) is not reads_it, model
        assert not torch.equal(ha[1], hb[1])  # from position 1 on, token 1 is in the trunk's input
    batch = PackedBatch.pack([[3, 4, 5, 13, 6, 2], [7, 7, 13]], [1, 1])
    layout = make_layout(batch, "padded", torch.device("cpu"), engine_for("dense_mtp").par, False)
    kept = layout.mtp_embedding_kept(1)[..., 0].transpose(0, 1)  # [B, L]
    assert kept[0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0] and kept[1].tolist()[:3] == [0.0, 1.0, 0.0]


def test_megatron_mimo_export_agrees_with_the_hf_mimo_model(fresh, tmp_path, figures):
    """megatron's MTP layers, changed away from the checkpoint (as training would), exported in
    MiMo's layout and loaded into core's HF MiMo model (:mod:`rlcore.engines.mimo`, the model
    vLLM's loader describes): MTP hidden states, MTP log-probs and the trunk's log-probs agree
    on packed sequences of several lengths."""
    from rlcore.heads import reference_logprobs
    from rlcore.testing.models import HFEngine
    from rlcore.types import HeadInput

    engine = fresh("dense_mtp")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in engine.named_parameters():
            if name.startswith("mtp."):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.save_hf(tmp_path / "export")
    hf = HFEngine.from_pretrained(tmp_path / "export")
    assert hf.info.mtp_layers == 1
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    with torch.no_grad():
        ours, theirs = engine.forward(batch, mtp_hidden=True), hf.forward(batch, mtp_hidden=True)
    labels, mask = batch.roll(batch.labels(), -1), batch.roll(batch.loss_mask, -1, fill=False)

    def lp(out, eng, hidden, lab):
        hw = eng.head()
        return reference_logprobs(HeadInput(hidden=hidden, weight=hw.weight, labels=lab, vocab=hw.vocab,
                                            loss_mask=batch.loss_mask)).logprobs

    hidden_diff = float((ours.mtp_hidden[0] - theirs.mtp_hidden[0]).abs().max())
    mtp_lp_diff = float((lp(ours, engine, ours.mtp_hidden[0], labels) - lp(theirs, hf, theirs.mtp_hidden[0], labels))
                        [mask].abs().max())
    trunk_diff = float((lp(ours, engine, ours.hidden, batch.labels()) - lp(theirs, hf, theirs.hidden, batch.labels()))
                       [batch.loss_mask].abs().max())
    figures("megatron MiMo export vs HF MiMo model, fp32",
            f"MTP hidden {hidden_diff:.1e}, MTP log-probs {mtp_lp_diff:.1e}, trunk log-probs {trunk_diff:.1e}")
    assert hidden_diff < 1e-5 and mtp_lp_diff < 1e-5 and trunk_diff < 1e-5


def test_r2_replay_records_and_replays_the_mtp_router(tmp_path):
    """R2 with replay.mtp: replay on a MoE + MTP model trained with rlcore-mtp: the recording pass
    runs the MTP layers too, so every routed token of every router, the MTP router's included, is
    replayed in the update (coverage 1.0; it was 0.8, the MTP router routing natively)."""
    import importlib.util

    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu_mtp.py"
    spec = importlib.util.spec_from_file_location("rlcore_megatron_gpu_mtp", bench)
    gpu_mtp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_mtp)
    res = gpu_mtp.train(tmp_path / "run", "cpu", 2, "reference", ["replay"],
                        ["replay.mode=R2", "algorithm.old_logprobs=recompute"])
    assert res["completed"]
    assert res["replay_coverage_first_last"] == [1.0, 1.0]
