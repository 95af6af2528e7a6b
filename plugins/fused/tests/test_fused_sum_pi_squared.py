"""Σπ² from the fused head (HeadInput.compute_sum_pi_squared, for the optimal-token baseline): the
softmax record's fifth row ``Σe^{2(z−m)}`` merged over vocabulary splits, the head declining its
fused loss when Σπ² is asked beside it, and the optimal-token baseline trained with the fused head.
(The conformance suite checks Σπ² against float64 for the torch backend here and for the Triton
kernels under the interpreter: scripts/suites/fused-triton.sh.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rlcore.algorithms import PPOClip, TokenObjective
from rlcore.testing.conformance import float64_sum_pi_squared
from rlcore.types import HeadInput, LossRequest, VocabShard
from rlcore_fused.head import FusedHead
from rlcore_fused.softmax_stats import empty_record, merge_records, sum_pi_squared
from rlcore_fused.torch_backend import TorchKernels

ROOT = Path(__file__).resolve().parents[3]


def _case(seed=0, T=23, H=16, V=37, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g) * scale, torch.randn(V, H, generator=g) * 0.5,
            torch.randint(0, V, (T,), generator=g))


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_records_of_vocabulary_splits_merge_to_the_whole_sum_pi_squared(scale):
    """Three splits of unequal size and an empty one (a rank holding only padding rows): merged,
    Q/S² is the whole softmax's Σπ² (×40 logits: each split's own max differs from the global one
    by hundreds, so a merge that rescaled q by e^{Δ} instead of e^{2Δ} would be far off). fp32
    against float64: logit errors δ ≲ 1e-6·|z| move Σπ² by e^{±4δ}, hence rtol 1e-4."""
    x, w, labels = _case(scale=scale)
    inv_temp = torch.full((x.shape[0],), 1 / 0.9)
    k = TorchKernels(chunk_tokens=7)
    bounds = [(0, 5), (5, 20), (20, 37)]
    parts = [k.local_record(x, w[a:b], labels - a, inv_temp, True, True) for a, b in bounds]
    parts.append(empty_record(x.shape[0], x.device, 5))
    merged = merge_records(torch.stack(parts))
    whole = k.local_record(x, w, labels, inv_temp, True, True)
    want = float64_sum_pi_squared(x, w, w.shape[0], 0.9, torch.ones(x.shape[0], dtype=torch.bool))
    torch.testing.assert_close(sum_pi_squared(merged).double(), want, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(sum_pi_squared(whole).double(), want, rtol=1e-4, atol=1e-7)
    # the four-row record (no Σπ² asked) is unchanged by the fifth row
    torch.testing.assert_close(merged[:4], merge_records(torch.stack([p[:4] for p in parts])))


def test_sum_pi_squared_beside_a_loss_request_declines_the_fused_loss():
    """The fused loss returns detached log-probs and no Σπ²; asked for both, the head declines the loss
    (core then forms it from differentiable log-probs) and returns Σπ²."""
    from rlcore.algorithms import TokenInputs

    x, w, labels = _case(1)
    T = x.shape[0]
    mask = torch.ones(T, dtype=torch.bool)
    inputs = TokenInputs(old_logprobs=torch.zeros(T), rollout_logprobs=torch.zeros(T), advantages=torch.ones(T),
                         mask=mask, weights=torch.full((T,), 1 / T), correction=None, ref_logprobs=None,
                         seq_index=torch.zeros(T, dtype=torch.long), seq_tokens=torch.tensor([float(T)]))
    h = x.clone().requires_grad_()
    out = FusedHead(backend="torch")(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(w.shape[0]),
                                               loss=LossRequest(TokenObjective(PPOClip()), inputs),
                                               compute_sum_pi_squared=True))
    assert out.loss is None and out.logprobs.requires_grad
    want = float64_sum_pi_squared(x, w, w.shape[0], 1.0, mask)
    torch.testing.assert_close(out.sum_pi_squared.double(), want, rtol=1e-4, atol=1e-7)


def test_optimal_token_baseline_trains_with_the_fused_head(tmp_path):
    from rlcore.testing.runs import main, read_metrics

    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), "--output", str(tmp_path),
                 "plugins=[fused,algorithms]", "forward.name=fused", "algorithm.name=optimal_token_baseline", "training.steps=2",
                 "data.prompts_per_step=4", "rollout.n=4", "output.checkpoint_every=0", "output.plot=false",
                 "output.tensorboard=false", "output.progress=false"]) == 0
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["advantage_abs_mean"]) for r in rows)
