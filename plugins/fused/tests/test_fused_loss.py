"""The fused-loss path (Cap.FUSED_LOSS) against the reference path: the reference head's
differentiable log-probs and entropy through core's plain objective (``TokenObjective.value`` times
the aggregation weights, autograd), versus the fused head forming the loss and its gradients
itself. Loss, log-probs, entropy, dX and dW must agree, with clipping, dual-clip, entropy bonus,
KL to a reference, mismatch correction, temperature, masks, padding vocab rows and several token
chunks. The Triton kernels run the same cases under the interpreter (test_triton_interpreter.py).
"""

from __future__ import annotations

import pytest
import rlcore_fused.plugin as plugin
import torch
from rlcore.algorithms import PPOClip, TokenInputs, TokenObjective
from rlcore.algorithms.aggregation import step_weights
from rlcore.heads import reference_logprobs
from rlcore.types import Cap, HeadInput, LossRequest, VocabShard
from rlcore_algorithms.losses import CISPO, GSPO  # rlcore-algorithms: a token-level and a sequence-level loss
from rlcore_fused.head import FusedHead

OBJECTIVES = {
    "ppo-dual-clip": TokenObjective(PPOClip(0.2, 0.28, 3.0)),
    "ppo+entropy+kl-k3": TokenObjective(PPOClip(0.2, 0.2, 3.0), kl_coef=0.1, kl_estimator="k3", entropy_coef=0.05),
    "ppo-no-dual+kl-k2": TokenObjective(PPOClip(0.1, 0.1, 0.0), kl_coef=0.2, kl_estimator="k2"),
    "cispo+entropy+kl-k1": TokenObjective(CISPO(1.0, 0.28), kl_coef=0.05, kl_estimator="k1", entropy_coef=0.01),
}


def make_case(seed=0, T=37, H=24, vocab=50, rows=56, dtype=torch.float32, agg="token-mean", temperature=0.8,
              correction=True, masked=True):
    """Hidden states, weight (``rows - vocab`` padding rows), labels, per-token inputs over 3
    sequences. Old log-probs are the current ones plus noise of std 0.5: ratios far enough from
    1 that both clip branches and dual-clip are active."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(rows, H, generator=g) * 0.6).to(dtype)
    labels = torch.randint(0, vocab, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.3 if masked else torch.ones(T, dtype=torch.bool)
    seq_index = torch.sort(torch.randint(0, 3, (T,), generator=g)).values
    with torch.no_grad():
        lp = reference_logprobs(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(vocab, rows),
                                          loss_mask=mask, temperature=temperature)).logprobs
    old = torch.where(mask, lp + 0.5 * torch.randn(T, generator=g), torch.zeros(T))
    sw = step_weights(agg, mask, seq_index, 3)
    x = TokenInputs(
        old_logprobs=old, rollout_logprobs=old + 0.01, advantages=torch.randn(T, generator=g), mask=mask,
        weights=sw.numerator / sw.divisor,
        correction=(torch.rand(T, generator=g) * 1.5).where(mask, torch.zeros(T)) if correction else None,
        ref_logprobs=torch.where(mask, lp + 0.3 * torch.randn(T, generator=g), torch.zeros(T)),
        seq_index=seq_index, seq_tokens=torch.zeros(3).index_add_(0, seq_index, mask.float()).clamp_min(1.0),
    )
    return h, w, labels, mask, x, VocabShard.full(vocab, rows), temperature


def reference_path(h, w, labels, mask, x, vocab, temperature, objective):
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    out = reference_logprobs(HeadInput(hidden=h, weight=w, labels=labels, vocab=vocab, loss_mask=mask,
                                       temperature=temperature))
    loss = (objective.value(out.logprobs, out.entropy, x) * x.weights).sum()
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), out.logprobs.detach(), out.entropy.detach(), gh, gw


def fused_path(head, h, w, labels, mask, x, vocab, temperature, objective, scale=1.0):
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    out = head(HeadInput(hidden=h, weight=w, labels=labels, vocab=vocab, loss_mask=mask, temperature=temperature,
                         loss=LossRequest(objective, x)))
    assert out.loss is not None and out.loss.requires_grad
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    gh, gw = torch.autograd.grad(out.loss * scale, (h, w))
    return out.loss.detach(), out.logprobs, out.entropy, gh, gw


def assert_paths_agree(head, case, objective, rtol=1e-5, atol=1e-6, grad_rtol=1e-4):
    ref = reference_path(*case, objective)
    got = fused_path(head, *case, objective)
    names = ("loss", "logprobs", "entropy", "dX", "dW")
    for name, a, b in zip(names, got, ref, strict=True):
        a, b = a.double(), b.double()
        if name in ("dX", "dW"):
            err = float((a - b).norm() / b.norm().clamp_min(1e-30))
            assert err < grad_rtol, f"{name}: relative error {err:.2e}"
        else:
            # the loss is a sum of terms of both signs: fp32 summation order shows at ~1e-6
            tol = max(atol, 1e-5) if name == "loss" else atol
            torch.testing.assert_close(a, b, rtol=rtol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
    # padding vocab rows and masked tokens get exactly zero gradient
    assert got[4][case[5].vocab_size:].abs().max() == 0
    if case[3] is not None:
        assert got[3][~case[3]].abs().max() == 0
    return got, ref


def test_capability_declared():
    assert Cap.FUSED_LOSS in next(iter(plugin.forward_fn())).capabilities


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_torch_backend_matches_reference_path(name, agg):
    case = make_case(seed=sorted(OBJECTIVES).index(name) * 2 + (agg == "token-mean"), agg=agg)
    assert_paths_agree(FusedHead(backend="torch", chunk_tokens=7), case, OBJECTIVES[name])


def test_clipping_and_dual_clip_are_exercised():
    """The case generator really hits every branch (otherwise the agreement says little)."""
    h, w, labels, mask, x, vocab, t = make_case()
    lp = reference_logprobs(HeadInput(hidden=h, weight=w, labels=labels, vocab=vocab, loss_mask=mask,
                                      temperature=t)).logprobs
    m = PPOClip(0.2, 0.28, 3.0).metrics(lp, x)
    assert 0 < float(m["clipfrac"][mask].mean()) < 1
    assert float(m["dual_clipfrac"][mask].sum()) > 0


def test_per_token_temperature_no_mask_no_correction():
    h, w, labels, mask, x, vocab, _ = make_case(seed=3, correction=False, masked=False)
    temp = 0.5 + torch.rand(h.shape[0], generator=torch.Generator().manual_seed(1))
    assert_paths_agree(FusedHead(backend="torch", chunk_tokens=5), (h, w, labels, None, x, vocab, temp),
                       OBJECTIVES["ppo+entropy+kl-k3"])


def test_bf16_inputs():
    case = make_case(seed=4, dtype=torch.bfloat16)
    # bf16 outputs: the gradients are compared at bf16 resolution
    assert_paths_agree(FusedHead(backend="torch", chunk_tokens=8), case, OBJECTIVES["ppo+entropy+kl-k3"],
                       rtol=1e-4, atol=1e-5, grad_rtol=2e-2)


def test_backward_scales_by_the_incoming_gradient():
    case = make_case(seed=5)
    obj = OBJECTIVES["ppo-dual-clip"]
    head = FusedHead(backend="torch", chunk_tokens=9)
    _, _, _, gh1, gw1 = fused_path(head, *case, obj)
    _, _, _, gh3, gw3 = fused_path(head, *case, obj, scale=-2.5)
    torch.testing.assert_close(gh3, -2.5 * gh1)
    torch.testing.assert_close(gw3, -2.5 * gw1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
def test_triton_on_gpu_backward_scales_in_place_without_sync():
    """On CUDA the stored gradients are scaled on the device (no host sync); a gradient of 1
    leaves them bitwise unchanged, any other scales them; a second backward is refused."""
    case = _to(make_case(seed=25, T=300, H=256, vocab=5000, rows=5120), "cuda")
    obj = OBJECTIVES["ppo-dual-clip"]
    head = FusedHead(backend="triton")
    _, _, _, gh1, gw1 = fused_path(head, *case, obj)
    _, _, _, gh3, gw3 = fused_path(head, *case, obj, scale=-2.5)
    torch.testing.assert_close(gh3, -2.5 * gh1)
    torch.testing.assert_close(gw3, -2.5 * gw1)
    ref = reference_path(*case, obj)
    assert float((gh1 - ref[3]).norm() / ref[3].norm()) < 1e-4
    h, w, labels, mask, x, vocab, t = case
    hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out = head(HeadInput(hidden=hh, weight=ww, labels=labels, vocab=vocab, loss_mask=mask, temperature=t,
                         loss=LossRequest(obj, x)))
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


def test_sequence_level_loss_is_declined():
    """GSPO needs the sequence's log-probs before any derivative: the head returns no loss and
    differentiable log-probs, so core's plain path forms it (never a silently wrong gradient)."""
    h, w, labels, mask, x, vocab, t = make_case(seed=6)
    hh = h.clone().requires_grad_(True)
    out = FusedHead(backend="torch")(HeadInput(hidden=hh, weight=w, labels=labels, vocab=vocab, loss_mask=mask,
                                               temperature=t, loss=LossRequest(TokenObjective(GSPO()), x)))
    assert out.loss is None
    assert out.logprobs.requires_grad
    (g,) = torch.autograd.grad(out.logprobs.sum(), hh)
    assert g.abs().sum() > 0


def test_postprocess_loss_term_still_gets_gradients():
    """With the fused loss, log-probs are detached; a postprocess term that needs differentiable
    log-probs (an MTP-style extra loss) calls the head again without a loss request, and the
    summed loss's gradient is the sum of both parts."""
    h, w, labels, mask, x, vocab, t = make_case(seed=7)
    obj = OBJECTIVES["ppo+entropy+kl-k3"]
    head = FusedHead(backend="torch", chunk_tokens=6)
    hh = h.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    inp = HeadInput(hidden=hh, weight=ww, labels=labels, vocab=vocab, loss_mask=mask, temperature=t,
                    loss=LossRequest(obj, x))
    out = head(inp)
    extra_out = head(HeadInput(hidden=hh, weight=ww, labels=labels, vocab=vocab, loss_mask=mask, temperature=t))
    extra = -0.3 * extra_out.logprobs.sum()
    gh, gw = torch.autograd.grad(out.loss + extra, (hh, ww))
    _, _, _, rh, rw = reference_path(h, w, labels, mask, x, vocab, t, obj)
    eh, ew = torch.autograd.grad(-0.3 * reference_logprobs(HeadInput(
        hidden=hh, weight=ww, labels=labels, vocab=vocab, loss_mask=mask, temperature=t)).logprobs.sum(), (hh, ww))
    torch.testing.assert_close(gh, rh + eh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, rw + ew, rtol=1e-4, atol=1e-6)


def _to(case, device):
    h, w, labels, mask, x, vocab, t = case
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in x.__dict__.items()}
    return (h.to(device), w.to(device), labels.to(device), None if mask is None else mask.to(device),
            TokenInputs(**fields), vocab, t.to(device) if isinstance(t, torch.Tensor) else t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("dw_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["ppo-dual-clip", "ppo+entropy+kl-k3", "cispo+entropy+kl-k1"])
def test_triton_on_gpu_matches_reference_path(name, dtype, dw_fp32):
    from rlcore_fused.tuning import TritonConfig

    case = _to(make_case(seed=21, T=300, H=256, vocab=5000, rows=5120, dtype=dtype), "cuda")
    # 64-token chunks: several chunks, dW accumulated over them
    head = FusedHead(backend="triton", triton_config=TritonConfig(loss_chunk_mib=64 * 5000 * 4 / 2**20,
                                                                  loss_dw_fp32=dw_fp32))
    bf16 = dtype == torch.bfloat16
    assert_paths_agree(head, case, OBJECTIVES[name], rtol=1e-4 if bf16 else 2e-5, atol=1e-5 if bf16 else 1e-6,
                       grad_rtol=2e-2 if bf16 else 1e-4)


def _record_path_agrees(case, objective, device, monkeypatch, **config):
    """The Triton fused loss through the tensor-parallel record path (the row kernel's record, the
    exchange and the merge; here an identity exchange: ``group_size`` patched to 2 with no group)
    and with or without the side-stream objective gives what the in-kernel finalisation gives."""
    import rlcore_fused.triton_backend as tb
    from rlcore_fused.tuning import TritonConfig

    case = _to(case, device)
    base = fused_path(FusedHead(backend="triton", triton_config=TritonConfig(**config)), *case, objective)
    serial = fused_path(FusedHead(backend="triton", triton_config=TritonConfig(loss_overlap=False, **config)),
                        *case, objective)
    monkeypatch.setattr(tb, "group_size", lambda group: 2)
    record = fused_path(FusedHead(backend="triton", triton_config=TritonConfig(**config)), *case, objective)
    for name, a, b, c in zip(("loss", "logprobs", "entropy", "dX", "dW"), base, serial, record, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m, n=name: f"overlap off, {n}: {m}")
        torch.testing.assert_close(c.double(), a.double(), rtol=2e-5, atol=2e-6, msg=lambda m, n=name: f"record, {n}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("pipeline", ["rows", "gemm", "gemm+dx"])
def test_triton_on_gpu_record_path_and_overlap_agree(monkeypatch, pipeline):
    case = make_case(seed=22, T=300, H=256, vocab=5000, rows=5120)
    _record_path_agrees(case, OBJECTIVES["ppo+entropy+kl-k3"], "cuda", monkeypatch,
                        loss_chunk_mib=64 * 5000 * 4 / 2**20, loss_pipeline=pipeline)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("pipeline", ["gemm", "gemm+dx"])
def test_triton_on_gpu_other_pipelines_match_reference_path(pipeline):
    from rlcore_fused.tuning import TritonConfig

    case = _to(make_case(seed=24, T=300, H=256, vocab=5000, rows=5120, dtype=torch.bfloat16), "cuda")
    head = FusedHead(backend="triton", triton_config=TritonConfig(loss_chunk_mib=64 * 5000 * 4 / 2**20,
                                                                  loss_pipeline=pipeline))
    assert_paths_agree(head, case, OBJECTIVES["ppo+entropy+kl-k3"], rtol=1e-4, atol=1e-5, grad_rtol=2e-2)


def test_out_of_vocab_label_is_an_error_only_where_loss_is_carried():
    """A label outside [0, vocab) at a token carrying loss is an error naming the range; at a
    masked token it is ignored (the kernels never see it)."""
    from rlcore.errors import BatchShapeError

    h, w, labels, mask, x, vocab, t = make_case(seed=9)
    obj = OBJECTIVES["ppo-dual-clip"]
    bad = labels.clone()
    bad[int((~mask).nonzero()[0])] = vocab.vocab_size  # masked: fine
    fused_path(FusedHead(backend="torch", chunk_tokens=7), h, w, bad, mask, x, vocab, t, obj)
    bad[int(mask.nonzero()[0])] = -1
    with pytest.raises(BatchShapeError, match=rf"must be in \[0, {vocab.vocab_size}\)"):
        fused_path(FusedHead(backend="torch", chunk_tokens=7), h, w, bad, mask, x, vocab, t, obj)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_fused_loss_matches_float64(sequence_parallel):
    """Two gloo processes, the vocab split in halves (rank 1's last rows padding): loss, log-probs,
    entropy, dW rows and the summed dX against the unsharded float64 reference."""
    from rlcore_fused.tp_check import run_fused_loss_tp_check

    run_fused_loss_tp_check("torch", sequence_parallel=sequence_parallel)


def everything_masked_gives_zero(head):
    """No token carries loss: loss 0 and exactly zero gradients (no uninitialised dW)."""
    h, w, labels, mask, x, vocab, t = make_case(seed=8)
    none = torch.zeros_like(mask)
    x = type(x)(**{**x.__dict__, "mask": none, "weights": torch.zeros_like(x.weights)})
    loss, lp, ent, gh, gw = fused_path(head, h, w, labels, none, x, vocab, t, OBJECTIVES["ppo+entropy+kl-k3"])
    assert float(loss) == 0 and lp.abs().max() == 0 and ent.abs().max() == 0
    assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_everything_masked_torch_backend():
    everything_masked_gives_zero(FusedHead(backend="torch", chunk_tokens=7))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")
def test_triton_on_gpu_compiled_objective_agrees():
    """``loss_compile_objective``: the objective through torch.compile (dynamic shapes: chunks and
    halves of several sizes here), against the reference path."""
    from rlcore_fused.tuning import TritonConfig

    case = _to(make_case(seed=23, T=300, H=256, vocab=5000, rows=5120), "cuda")
    head = FusedHead(backend="triton", triton_config=TritonConfig(loss_chunk_mib=64 * 5000 * 4 / 2**20,
                                                                  loss_compile_objective=True))
    assert_paths_agree(head, case, OBJECTIVES["ppo+entropy+kl-k3"], rtol=2e-5, atol=1e-6, grad_rtol=1e-4)
