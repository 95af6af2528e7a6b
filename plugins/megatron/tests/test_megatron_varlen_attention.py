"""The THD path without Transformer Engine (issue 31 item 4): megatron-core's local layer spec with
:class:`rlcore_megatron.varlen_attention.VarlenDotProductAttention`, fed the engine's THD layout
(``[1, T]`` + ``PackedSeqParams``), equals the padded rows in log-probs and gradients.

On CPU the varlen attention is SDPA per sequence (torch's flash varlen kernel is CUDA-only); the
layout, RoPE per ``cu_seqlens`` inside megatron's ``Attention`` and the module's scale and head
grouping are the same code the GPU runs. Tolerances (fp32): the two paths sum in a different
order (a ``[B, L]`` masked softmax vs. one softmax per sequence), float32 rounding only: 1e-5
absolute on log-probs, 1e-4 relative on gradients, far below what a token attending across a
sequence boundary would change (~1e-1 at these sizes).
"""

from __future__ import annotations

import pytest
import torch
from rlcore.batch import PackedBatch

pytestmark = pytest.mark.engine("megatron")

LENGTHS = (1, 9, 17, 2, 5)


def _batch(align: int) -> PackedBatch:
    seqs = [torch.randint(3, 13, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    return PackedBatch.pack(seqs, [1] * len(seqs), align=align)


def _models(engine):
    """The engine's model rebuilt twice (padded path, THD path without TE) with its weights."""
    from rlcore_megatron.model import build_model

    out = {}
    for path in ("padded", "thd"):
        built = build_model(engine.spec, engine.settings, engine.par, engine.padded_vocab, path, engine.device,
                            engine.dtype)
        built.model.load_state_dict(engine.model.state_dict())
        out[path] = built
    return out


def _logprobs(model, batch, path, engine):
    from rlcore_megatron import compat
    from rlcore_megatron.layout import make_layout

    layout = make_layout(batch, path, engine.device, engine.par, False)
    with compat.head_seam(model) as run:
        hidden = layout.to_packed(run(layout.input_ids, layout.position_ids, layout.attention_mask,
                                      **layout.model_kwargs))
    logits = hidden.float() @ model.output_layer.weight.float().T
    labels = batch.labels().clamp(min=0)
    return torch.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1) * batch.loss_mask


@pytest.mark.parametrize("name", ["dense_kv2", "moe_kv2"])
@pytest.mark.parametrize("align", [1, 4])
def test_thd_without_te_equals_padded_logprobs_and_gradients(engine_for, name, align):
    from rlcore_megatron.varlen_attention import VarlenDotProductAttention

    engine = engine_for(name)
    assert engine.attention_path == "padded"  # CPU: the engine's own choice is unchanged
    models = _models(engine)
    assert models["thd"].thd_backend == "sdpa_per_sequence" and models["padded"].thd_backend is None
    cores = [type(layer.self_attention.core_attention) for layer in models["thd"].model.decoder.layers]
    assert cores and all(c is VarlenDotProductAttention for c in cores)
    batch = _batch(align)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    logprobs, grads = {}, {}
    for path, built in models.items():
        lp = _logprobs(built.model, batch, path, engine)
        (lp * weights).sum().backward()
        logprobs[path] = lp.detach()
        grads[path] = {n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(logprobs["thd"], logprobs["padded"], atol=1e-5, rtol=0)
    assert grads["thd"].keys() == grads["padded"].keys() and grads["padded"]
    for n in grads["padded"]:
        torch.testing.assert_close(grads["thd"][n], grads["padded"][n], atol=1e-5, rtol=1e-4, msg=n)


def test_thd_without_te_keeps_sequences_apart(engine_for):
    """A sequence's log-probs on the THD path are those it has alone."""
    engine = engine_for("dense_kv2")
    thd = _models(engine)["thd"].model
    batch = _batch(4)
    together = _logprobs(thd, batch, "thd", engine).detach()
    starts = batch.layout.starts.tolist()
    for n, start in zip(LENGTHS, starts, strict=True):
        alone = PackedBatch.pack([batch.input_ids[start:start + n]], [1])
        torch.testing.assert_close(together[start:start + n], _logprobs(thd, alone, "thd", engine).detach(),
                                   atol=1e-5, rtol=0)


def test_auto_is_thd_on_cuda_and_padded_on_cpu():
    from rlcore.errors import ConfigError
    from rlcore_megatron.model import choose_attention_path, uses_transformer_engine
    from rlcore_megatron.settings import MegatronSettings

    assert choose_attention_path(MegatronSettings(), torch.device("cpu")) == "padded"
    assert choose_attention_path(MegatronSettings(), torch.device("cuda")) == "thd"  # TE or torch varlen
    assert choose_attention_path(MegatronSettings(attention="local"), torch.device("cuda")) == "padded"
    if not uses_transformer_engine(torch.device("cuda")):
        with pytest.raises(ConfigError) as err:
            choose_attention_path(MegatronSettings(sequence_parallel=True, tensor_parallel_size=2),
                                  torch.device("cuda"))
        assert err.value.key == "megatron.sequence_parallel"
