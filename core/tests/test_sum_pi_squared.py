"""The reference head's Σπ² (``HeadOutput.sum_pi_squared``, asked for by an algorithm whose spec
needs ``Cap.SUM_PI_SQUARED``: rlcore-algorithms' optimal-token baseline, tested in
plugins/algorithms/tests/test_optimal_token_baseline.py) against float64."""

from __future__ import annotations

import pytest
import torch
from rlcore.heads import reference_logprobs
from rlcore.testing.conformance import float64_sum_pi_squared
from rlcore.types import HeadInput, VocabShard


@pytest.mark.parametrize("chunk_tokens", [5, 2048])
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_reference_head_sum_pi_squared_against_float64(chunk_tokens, scale):
    """fp32 logits differ from float64 by δ ≲ 1e-6·|z| here; Σπ² = Σ e^{2(z−lse)} then moves by a
    factor e^{±4δ}: rtol 1e-4 covers the ×40 logits (|z| up to ~200: a shift by anything but the
    max would overflow e^{2z} in fp32)."""
    g = torch.Generator().manual_seed(3)
    T, H, V, rows = 29, 16, 40, 48
    hidden = torch.randn(T, H, generator=g) * scale
    weight = torch.randn(rows, H, generator=g) * 0.5
    weight[V:] = 5.0  # padding rows: counted by mistake, they would dominate
    labels = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.25
    out = reference_logprobs(HeadInput(hidden=hidden, weight=weight, labels=labels, vocab=VocabShard.full(V, rows),
                                       loss_mask=mask, temperature=0.8, compute_sum_pi_squared=True), chunk_tokens)
    want = float64_sum_pi_squared(hidden, weight, V, 0.8, mask)
    torch.testing.assert_close(out.sum_pi_squared.double(), want, rtol=1e-4, atol=1e-7)
    # Σπ² ≥ π(label)²: the sampled token's own term
    assert bool((out.sum_pi_squared + 1e-6 >= out.logprobs.exp() ** 2 * mask).all())
