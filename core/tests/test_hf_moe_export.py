"""The HF engine's export covers MoE models whose experts transformers keeps fused in memory
(issue 12 item 5): Mixtral and OLMoE raised on main. The export must give exactly the tensors a
checkpoint of the model holds (names, shapes, values), so engines can load it."""

from __future__ import annotations

import pytest
import torch
from rlcore.engines.hf_names import checkpoint_tensors
from safetensors.torch import load_file


def _tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, num_experts_per_tok=2)
    extra = {"mixtral": dict(num_local_experts=4), "olmoe": dict(num_experts=4)}[model_type]
    cfg = AutoConfig.for_model(model_type, **common, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe"])
def test_fused_expert_export_equals_the_checkpoint(model_type, tmp_path):
    model = _tiny(model_type)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters()), "experts are fused"
    model.save_pretrained(tmp_path)
    saved = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    exported = {n: t.detach().clone() for n, t in checkpoint_tensors(model)}
    assert sorted(exported) == sorted(saved)
    for name, t in saved.items():
        assert exported[name].shape == t.shape, name
        torch.testing.assert_close(exported[name], t, rtol=0, atol=0, msg=name)
    expert = {"mixtral": "model.layers.1.block_sparse_moe.experts.3.w2.weight",
              "olmoe": "model.layers.1.mlp.experts.3.down_proj.weight"}[model_type]
    assert expert in exported


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe"])
def test_fused_expert_views_load_back(model_type):
    """Copying into the views loads (the local rollout receives pushes this way)."""
    src, dst = _tiny(model_type), _tiny(model_type)
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
        views = dict(checkpoint_tensors(dst))
        for name, t in checkpoint_tensors(src):
            views[name].copy_(t)
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
