"""The no-padding attention path (issue 31 item 4): :mod:`rlcore.engines.varlen` and the ``hf``
engine's ``engine.attention=packed``, equal to the padded rows in hidden states, log-probs,
gradients and recorded routes.

Tolerances (fp32, CPU): both paths compute the same sums in a different order (SDPA over a
``[B, L_max]`` batch with a mask vs. SDPA over each sequence alone), so they differ by float32
rounding only: ~1e-7 relative per op, a few 1e-6 after two layers and a log-softmax over the
vocabulary. 1e-5 absolute on log-probs (values of order 1-10) and 1e-4 relative on gradients
leave a margin over that and are far below any real difference (a token seeing its neighbour
sequence moves log-probs by ~1e-1 at these sizes; the leak test below shows it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rlcore.batch import PackedBatch
from rlcore.config import TinyModelConfig
from rlcore.engines.hf import HFEngine
from rlcore.engines.tiny import make_tiny_model, make_tokenizer
from rlcore.engines.varlen import SDPA_PER_SEQUENCE, varlen_attention, varlen_backend
from rlcore.errors import ConfigError
from rlcore.stack import load_config, resolve
from rlcore.testing.conformance import EngineConformance

WORDS = [str(i) for i in range(10)]
TINY = dict(hidden_size=32, head_dim=16, num_heads=4, num_kv_heads=2, intermediate_size=48, num_layers=2)
LENGTHS = (1, 7, 23, 2, 13, 5)


def _engine(attention: str, arch: str = "qwen2", mtp_layers: int = 0) -> HFEngine:
    tok = make_tokenizer(WORDS)
    cfg = TinyModelConfig(**TINY, arch=arch, mtp_layers=mtp_layers, num_experts=4, topk=2, moe_intermediate_size=16)
    return HFEngine(make_tiny_model(cfg, tok), tok, attention=attention)


def _batch(lengths=LENGTHS, align: int = 1) -> PackedBatch:
    seqs = [torch.randint(3, 13, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    return PackedBatch.pack(seqs, [1] * len(lengths), align=align)


def _logprobs(engine: HFEngine, batch: PackedBatch) -> torch.Tensor:
    hidden = engine.forward(batch).hidden
    logits = hidden.float() @ engine.head().weight.float().T
    labels = batch.labels().clamp(min=0)
    return torch.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1) * batch.loss_mask


def _dense_reference(q, k, v, cu):
    """Causal attention under a block-diagonal mask over the whole token axis."""
    T = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.as_tensor(cu)))
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=allowed).transpose(0, 1)


def test_varlen_attention_is_causal_within_each_sequence_only():
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 3, 4, 11, 20], dtype=torch.int32)
    q = torch.randn(20, 4, 8, generator=g)
    k, v = torch.randn(20, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g)
    out = varlen_attention(q, k, v, cu, max_seqlen=9)
    torch.testing.assert_close(out, _dense_reference(q, k, v, cu.tolist()), atol=1e-6, rtol=1e-5)
    assert varlen_backend("cpu", torch.bfloat16) == SDPA_PER_SEQUENCE  # the flash kernel is CUDA-only


def test_auto_is_padded_on_cpu_and_packed_runs_when_asked():
    assert _engine("auto").attention_path == "padded"
    assert _engine("packed").attention_path == "packed"
    with pytest.raises(ConfigError) as err:
        _engine("unpadded")
    assert err.value.key == "engine.attention"
    with pytest.raises(ConfigError, match="MTP layers") as err:
        _engine("packed", mtp_layers=1)
    assert err.value.key == "engine.attention"
    assert _engine("auto", mtp_layers=1).attention_path == "padded"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
@pytest.mark.parametrize("align", [1, 4])
def test_packed_logprobs_and_gradients_equal_padded(arch, align):
    padded, packed = _engine("padded", arch), _engine("packed", arch)
    packed.model.load_state_dict(padded.model.state_dict())
    batch = _batch(align=align)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(2))
    grads = []
    for engine in (padded, packed):
        lp = _logprobs(engine, batch)
        (lp * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None})
        if engine is padded:
            lp_padded = lp.detach()
    torch.testing.assert_close(lp.detach(), lp_padded, atol=1e-5, rtol=0)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_path_keeps_sequences_apart():
    """Each sequence's log-probs are its own: the same as when it runs alone (no leak across a boundary)."""
    engine = _engine("packed")
    batch = _batch()
    together = _logprobs(engine, batch).detach()
    start = 0
    for n in LENGTHS:
        alone = _logprobs(engine, _batch((n,)))  # the same tokens: each sequence's are seeded by its length
        torch.testing.assert_close(together[start:start + n], alone.detach(), atol=1e-5, rtol=0)
        start += n


def test_packed_routes_equal_padded_routes():
    padded, packed = _engine("padded", "qwen3_moe"), _engine("packed", "qwen3_moe")
    packed.model.load_state_dict(padded.model.state_dict())
    batch = _batch(align=4)
    with torch.no_grad():
        routes = [e.forward(batch, record_routes=True).routes for e in (padded, packed)]
    assert routes[0] is not None and torch.equal(routes[0], routes[1])


def test_engine_attention_is_checked_at_config_time_by_key():
    cfg, _ = load_config(None, [])
    assert cfg.engine.attention == "auto"
    with pytest.raises(ConfigError, match="bad value for config key 'engine.attention'") as err:
        load_config(None, ["engine.attention=unpadded"])
    assert err.value.key == "engine.attention"


def test_a_run_trains_on_the_packed_path(rlcore_config, rlcore_plugin_manager, tmp_path):
    """engine.attention=packed reaches the built engine, and a run trains through it."""
    from rlcore.trainer import Trainer

    cfg = rlcore_config(f"output.dir={tmp_path / 'run'}", "engine.attention=packed", "training.steps=2",
                        "rollout.n=2", "data.prompts_per_step=2", "output.plot=false", "output.tensorboard=false",
                        "output.progress=false")
    trainer = Trainer(resolve(cfg, rlcore_plugin_manager))
    assert trainer.engine.attention_path == "packed"
    trainer.run()


class TestPackedHFEngineConformance(EngineConformance):
    """The engine conformance suite (log-probs against float64, routes, MoE replay, ...) on the packed path."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        return lambda d: HFEngine.from_pretrained(d, attention="packed")


def test_a_run_resumes_with_the_other_attention_path():
    """Packed and padded rows compute the same attention (summed in another order), so a run
    trained with one may resume with the other, as with ``engine.device``."""
    from rlcore.config import training_fingerprint

    padded, _ = load_config(None, ["engine.attention=padded"])
    packed, _ = load_config(None, ["engine.attention=packed"])
    assert training_fingerprint(padded) == training_fingerprint(packed)
