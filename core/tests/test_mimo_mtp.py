"""MTP on the HF engine in MiMo's layout (issue 14 item 3): names vLLM loads, save/load round
trip, the semantics of each depth, packed-sequence boundaries, and sync carrying the MTP layers."""

from __future__ import annotations

import json

import pytest
import torch
from rlcore import errors
from rlcore.batch import PackedBatch
from rlcore.config import TinyModelConfig
from rlcore.engines import mimo_layout
from rlcore.engines.hf import HFEngine
from rlcore.engines.tiny import make_tiny_model, make_tokenizer
from safetensors.torch import load_file

WORDS = [str(i) for i in range(10)]
TINY = dict(hidden_size=32, head_dim=16, num_heads=2, num_kv_heads=1, intermediate_size=48)


def _engine(mtp_layers=2, seed=0, tie=False):
    tok = make_tokenizer(WORDS)
    cfg = TinyModelConfig(**TINY, mtp_layers=mtp_layers, seed=seed, tie_word_embeddings=tie)
    return HFEngine(make_tiny_model(cfg, tok), tok)


def _batch(seqs):
    return PackedBatch.pack(seqs, [1] * len(seqs))


def test_names_shapes_and_config_are_mimos(tmp_path):
    engine = _engine(mtp_layers=2)
    assert engine.info.mtp_layers == 2
    names = {n: tuple(p.shape) for n, p in engine.model.named_parameters() if mimo_layout.is_mtp_name(n)}
    assert sorted(names) == sorted(mimo_layout.tensor_names(2))
    shapes = mimo_layout.tensor_shapes(32, 48, 2, 1, 16)
    for name, shape in names.items():
        assert shape == shapes[mimo_layout.split_name(name)[1]], name
    assert not any("mtp_block" in n for n in names)  # vLLM inserts it on load
    # embeddings and LM head are shared: the MTP layers own no copy
    assert not any(n.endswith(("embed_tokens.weight", "lm_head.weight")) for n in names)

    engine.save_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [mimo_layout.ARCHITECTURE]
    assert cfg[mimo_layout.NUM_LAYERS_KEY] == 2 and cfg["model_type"] == "qwen2"
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    assert mimo_layout.missing_names(saved, 2) == []
    exported = dict(engine.export_hf_weights())
    assert sorted(exported) == sorted(saved)


def test_save_load_round_trip_keeps_mtp_weights_and_outputs(tmp_path):
    engine = _engine(mtp_layers=2, seed=3)
    batch = _batch([[3, 4, 5, 6, 7, 8], [9, 3, 4]])
    before = engine.forward(batch, mtp_hidden=True)
    engine.save_hf(tmp_path)
    loaded = HFEngine.from_pretrained(tmp_path)
    assert type(loaded.model).__name__ == "MiMoForCausalLM" and loaded.info.mtp_layers == 2
    ref = dict(engine.model.named_parameters())
    for n, p in loaded.model.named_parameters():
        torch.testing.assert_close(p, ref[n], rtol=0, atol=0, msg=n)
    after = loaded.forward(batch, mtp_hidden=True)
    for a, b in zip(before.mtp_hidden, after.mtp_hidden, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_mimo_directory_without_mtp_tensors_is_refused(tmp_path):
    from safetensors.torch import save_file

    engine = _engine(mtp_layers=1)
    engine.save_hf(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    save_file({k: v for k, v in load_file(str(f)).items() if not mimo_layout.is_mtp_name(k)}, str(f),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="MTP tensors missing"):
        HFEngine.from_pretrained(tmp_path)


def test_depth_k_reads_tokens_up_to_t_plus_k_and_zeroes_position_0():
    """Depth k at position t >= 1 depends on exactly the tokens 0..t+k (DeepSeek/MiMo MTP); at
    position 0 every depth's embedding is zeroed (vLLM's MiMo layer), so it sees token 0 only."""
    engine = _engine(mtp_layers=2, seed=1)
    base = [3, 4, 5, 6, 7, 8, 9]
    out0 = engine.forward(_batch([base]), mtp_hidden=True).mtp_hidden
    T = len(base)
    for j in range(T):
        seq = list(base)
        seq[j] = 2
        out = engine.forward(_batch([seq]), mtp_hidden=True).mtp_hidden
        for k, (h0, h1) in enumerate(zip(out0, out, strict=True), start=1):
            changed = (h0 - h1).abs().amax(dim=1) > 1e-6
            expect = torch.tensor([(t >= 1 and t + k >= j) or (t == 0 and j == 0) for t in range(T)])
            assert torch.equal(changed, expect), (j, k, changed.tolist())


def test_trunk_input_is_the_pre_norm_hidden_state():
    engine = _engine(mtp_layers=1)
    batch = _batch([[3, 4, 5, 6]])
    ids = batch.input_ids.view(1, -1)
    with engine.model.trunk_prenorm_hidden() as trunk:
        out = engine.model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids))
    torch.testing.assert_close(engine.model.model.norm(trunk.value), out.last_hidden_state)
    assert not torch.allclose(trunk.value, out.last_hidden_state)


def test_packed_sequences_do_not_see_each_other():
    engine = _engine(mtp_layers=2, seed=2)
    a, b, c = [3, 4, 5, 6, 7], [8, 9], [4, 4, 5, 6]
    alone = [engine.forward(_batch([s]), mtp_hidden=True).mtp_hidden for s in (a, b, c)]
    packed = engine.forward(_batch([a, b, c]), mtp_hidden=True).mtp_hidden
    other = engine.forward(_batch([a, [9, 8], c]), mtp_hidden=True).mtp_hidden
    starts = [0, 5, 7]
    for d in range(2):
        for s, (st, seq) in enumerate(zip(starts, (a, b, c), strict=True)):
            torch.testing.assert_close(packed[d][st: st + len(seq)], alone[s][d], atol=1e-5, rtol=1e-5)
        # changing sequence b changes nothing in a or c (depth d looks d+1 tokens ahead: not across)
        torch.testing.assert_close(other[d][:5], packed[d][:5], rtol=0, atol=0)
        torch.testing.assert_close(other[d][7:], packed[d][7:], rtol=0, atol=0)


def test_detach_trunk_sends_mtp_gradients_to_mtp_layers_only():
    for detach in (False, True):
        engine = _engine(mtp_layers=2, seed=4)
        out = engine.forward(_batch([[3, 4, 5, 6, 7], [8, 9, 3]]), mtp_hidden=True, mtp_detach_trunk=detach)
        sum(h.square().sum() for h in out.mtp_hidden).backward()
        got = {n for n, p in engine.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        mtp = {n for n in got if mimo_layout.is_mtp_name(n)}
        assert mtp == set(mimo_layout.tensor_names(2))
        trunk = got - mtp
        if detach:
            assert trunk == set()
        else:
            assert "model.embed_tokens.weight" in trunk and "model.layers.0.self_attn.q_proj.weight" in trunk
            assert "model.norm.weight" not in trunk  # depth 1 reads the pre-norm hidden state


def test_models_without_mtp_layers_refuse_mtp_hidden():
    engine = _engine(mtp_layers=0)
    with pytest.raises(errors.MissingCapabilityError, match="has no MTP layers.*mtp_layers >= 1"):
        engine.forward(_batch([[3, 4, 5]]), mtp_hidden=True)
    from rlcore.engines.tiny import check_hf_mtp

    with pytest.raises(ValueError, match="engine.model.tiny.arch 'qwen2'"):
        check_hf_mtp(TinyModelConfig(**TINY, arch="qwen3_moe", mtp_layers=1))
    # the MoE archs still get a plain model (the megatron engine builds its own MTP layers)
    moe = make_tiny_model(TinyModelConfig(**TINY, arch="qwen3_moe", mtp_layers=1), make_tokenizer(WORDS))
    assert type(moe).__name__ == "Qwen3MoeForCausalLM" and moe.config.num_nextn_predict_layers == 1


@pytest.mark.parametrize("sync_name", ["inproc", "disk"])
def test_sync_carries_mtp_layers_into_the_local_rollout(tmp_path, sync_name):
    from rlcore.rollout_local import LocalRollout
    from rlcore.weight_sync import DiskSync, InprocSync

    engine = _engine(mtp_layers=2, seed=5)
    engine.save_hf(tmp_path / "v0")
    rollout = LocalRollout()
    rollout.start(str(tmp_path / "v0"))
    held = rollout.weight_manifest()
    assert set(mimo_layout.tensor_names(2)) <= set(held.shapes)
    with torch.no_grad():
        for n, p in engine.model.named_parameters():
            if mimo_layout.is_mtp_name(n):
                p.add_(0.5)
    sync = InprocSync(bucket_bytes=1 << 16) if sync_name == "inproc" else DiskSync(tmp_path / "push", 1 << 16)
    report = sync.push(engine.export_hf_weights(), rollout, version=1)
    assert rollout.weight_version == 1 and report is not None
    mine = dict(engine.model.named_parameters())
    for name in mimo_layout.tensor_names(2):
        torch.testing.assert_close(rollout._views[name], mine[name].detach(), rtol=0, atol=0, msg=name)
