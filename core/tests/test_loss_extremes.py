"""Issue 38 item 5, core's part: PPO-clip without dual-clip bounded as verl at large log-ratios,
and the adaptive KL's measured sequences and a step without loss tokens. Every loss (core's and
rlcore-algorithms') at extreme log-probs, by hypothesis over dtypes, aggregations and core's terms:
plugins/algorithms/tests/test_loss_extremes.py."""

from __future__ import annotations

import math

import pytest
import torch
from rlcore.algorithms.losses import PPOClip, TokenObjective
from rlcore.algorithms.spec import TokenInputs

#: verl's clamp (core_algos.py) of the token log-ratio before exp
TOKEN_LOG_RATIO_BOUND = 20.0


def _inputs(old, adv, dtype=torch.float32):
    old = torch.tensor(old, dtype=dtype)
    n = old.numel()
    mask = torch.ones(n, dtype=torch.bool)
    return TokenInputs(old_logprobs=old, rollout_logprobs=old, advantages=torch.tensor(adv, dtype=dtype), mask=mask,
                       weights=mask.to(dtype), correction=None, ref_logprobs=None,
                       seq_index=torch.zeros(n, dtype=torch.long), seq_tokens=mask.sum().clamp_min(1).to(dtype)[None])


def _autograd(loss, logp, x):
    lp = torch.tensor(logp, dtype=x.old_logprobs.dtype, requires_grad=True)
    v = TokenObjective(loss).value(lp, None, x, None)
    v.sum().backward()
    return v.detach(), lp.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ppo_clip_without_dual_clip_is_bounded_as_verl_at_large_log_ratios(dtype):
    """A < 0, logp − old = 30 and 1e4 (a rollout log-prob far below the trainer's): the
    unclipped branch is active, its value is −A·e^20 (verl's clamp of the log-ratio, not
    −A·e^30 or inf) and its gradient 0 past the clamp; with A > 0 the clipped branch is."""
    loss = PPOClip(0.2, 0.28, 0.0)
    x = _inputs([-30.5, -1e4 - 0.5, -30.5], [-2.0, -2.0, 2.0], dtype=dtype)
    v, g = _autograd(loss, [-0.5, -0.5, -0.5], x)
    bound = 2.0 * math.exp(TOKEN_LOG_RATIO_BOUND)
    assert v.tolist()[:2] == pytest.approx([bound, bound], rel=1e-2)
    assert v.tolist()[2] == pytest.approx(-2.0 * 1.28, rel=1e-2)
    assert g.tolist() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------- adaptive KL control --

class _Batch:
    """What ``KLControl.step_end`` reads of a step batch."""

    def __init__(self, kl_per_token: list[list[float]], masks: list[list[bool]]):
        lens = [len(m) for m in masks]
        self.loss_mask = torch.tensor([b for m in masks for b in m], dtype=torch.bool)
        ref = torch.zeros(sum(lens))
        # k1 = logp − ref: the recomputed log-probs carry the per-token KL wanted
        self.fields = {"recomputed_logprobs": torch.tensor([k for row in kl_per_token for k in row]) + ref,
                       "ref_logprobs": ref}
        self._index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        self.num_seqs = len(lens)

    def seq_sum(self, t):
        return torch.zeros(self.num_seqs, dtype=t.dtype).index_add_(0, self._index, t)


def test_adaptive_kl_is_measured_over_the_sequences_with_loss_tokens():
    """Two sequences with loss tokens (mean KL 0.1 and 0.3) and one fully masked one (its
    garbage KL 50 is never read): the controller measures 0.2, not verl's (0.1 + 0.3 + 0)/3
    (docs/algorithms.md: masking a sample must not read as a smaller KL); n counts every sample."""
    from rlcore.algorithms.kl_control import KLControl

    c = KLControl(0.1, target=0.1, horizon=100, estimator="k1")
    batch = _Batch([[0.1, 0.1], [0.3], [50.0, 50.0]], [[True, True], [True], [False, False]])
    obj, metrics = c.step_end(TokenObjective(PPOClip()), batch)
    assert metrics["kl_control/kl"] == pytest.approx(0.2)
    assert c.beta == pytest.approx(0.1 * (1 + 0.2 * 3 / 100)) and obj.kl_coef == c.beta


def test_a_step_without_loss_tokens_leaves_the_adaptive_kl_coefficient_unchanged():
    """Every response masked (e.g. all truncated under DAPO's overlong filter): nothing was
    measured, so β stays (the old code, as verl, read KL 0 and shrank β by 20 %·n/horizon)."""
    from rlcore.algorithms.kl_control import KLControl

    c = KLControl(0.1, target=0.1, horizon=10, estimator="k1")
    obj, metrics = c.step_end(TokenObjective(PPOClip()), _Batch([[5.0], [5.0, 5.0]], [[False], [False, False]]))
    assert c.beta == 0.1 and metrics == {"kl_control/beta": 0.1} and obj.kl_coef == 0.1
