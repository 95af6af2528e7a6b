"""Issue 38 item 5: every policy loss, core's and rlcore-algorithms', with core's KL, entropy and correction terms, stays
finite at extreme log-ratios (a rollout log-prob of −100 or −inf, the reference as far), with
empty and fully masked responses and garbage (NaN, ±inf, 1e30) on masked tokens, in float32,
bfloat16 and float64; and the trainer's autograd path and the closed form a fused head uses
(``TokenObjective.closed_form``) agree there. The bounds are verl's where verl clamps (token
log-ratio ±20, GSPO's sequence log-ratio ≤ 10); docs/algorithms.md lists where rlcore bounds
what verl does not."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlcore.algorithms import objective as objmod
from rlcore.algorithms.aggregation import step_weights
from rlcore.algorithms.losses import TokenObjective, kl_value_and_grad
from rlcore.algorithms.spec import KL_ESTIMATORS, LOSS_AGGREGATIONS, TokenInputs
from rlcore.batch import PackedBatch
from rlcore.builtin.algorithms import algorithm
from rlcore.testing.algorithm_conformance import algorithm_section
from rlcore_algorithms.losses import GSPO
from rlcore_algorithms.plugin import algorithm as plugin_algorithms
from rlcore_algorithms.surrogates import DRO, KLCov

SPECS = {s.name: s for s in (*algorithm(), *plugin_algorithms())}
#: every algorithm's loss (core's built-ins and this plugin's) at its defaults, and PPO-clip with dual-clip off
LOSSES = {name: spec.factory(algorithm_section(spec)).loss for name, spec in sorted(SPECS.items())}
LOSSES["grpo clip_ratio_c=0"] = SPECS["grpo"].factory(algorithm_section(SPECS["grpo"], ["algorithm.clip_ratio_c=0"])).loss
#: verl's clamps (core_algos.py): the token log-ratio to ±20 before exp (PPO-clip, CISPO, SAPO,
#: DPPO; k3's ref − logp too), GSPO's sequence log-ratio to ≤ 10
TOKEN_LOG_RATIO_BOUND, SEQ_LOG_RATIO_MAX = 20.0, 10.0
PROXIMAL = objmod.ROLLOUT  # the ratio against the rollout's log-probs, where −100 / −inf arrive
#: unit roundoff of each dtype: the agreement tolerance is a few of these (below)
UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
#: what a head or the batch may leave on tokens the loss mask excludes
GARBAGE = [math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, 7.0]
FIELDS = ("logprobs", objmod.ROLLOUT, "ref_logprobs", objmod.ADVANTAGES, "entropy", objmod.CORRECTION)

finite_logprob = st.floats(-100.0, 0.0, allow_nan=False, width=32)
extreme_logprob = st.one_of(finite_logprob, st.sampled_from([-100.0, -math.inf, -1e4, -20.5, -0.0]))


@st.composite
def responses(draw):
    """1-4 sequences: a prompt and 0-5 response tokens each, some masked (rows may be empty or
    fully masked); per response token the current log-prob, the rollout's and the reference's
    (extreme ones included), the advantage, entropy and correction weight."""
    seqs, starts, masks = [], [], []
    fields: dict[str, list[torch.Tensor]] = {k: [] for k in FIELDS}
    for _ in range(draw(st.integers(1, 4))):
        p, r = draw(st.integers(1, 3)), draw(st.integers(0, 5))
        seqs.append(torch.arange(p + r) % 7)
        starts.append(p)
        masks.append(torch.tensor(draw(st.lists(st.booleans(), min_size=r, max_size=r)), dtype=torch.bool))
        per_token = {
            "logprobs": finite_logprob, objmod.ROLLOUT: extreme_logprob, "ref_logprobs": extreme_logprob,
            objmod.ADVANTAGES: st.one_of(st.just(0.0), st.floats(-10.0, 10.0, width=32)),
            "entropy": st.floats(0.0, 12.0, width=32), objmod.CORRECTION: st.floats(0.0, 3.0, width=32),
        }
        for k, strategy in per_token.items():
            fields[k].append(torch.tensor(draw(st.lists(strategy, min_size=r, max_size=r)), dtype=torch.float64))
    return seqs, starts, masks, fields, draw(st.sampled_from(GARBAGE))


def _batch(drawn, dtype, correction: bool) -> PackedBatch:
    seqs, starts, masks, fields, garbage = drawn
    if not correction:
        fields = {k: v for k, v in fields.items() if k != objmod.CORRECTION}
    batch = PackedBatch.pack(seqs, starts, target_fields=fields, response_masks=masks)
    for k in fields:  # masked tokens (prompts, padding, masked responses) hold garbage
        batch.fields[k] = torch.where(batch.loss_mask, batch.fields[k], torch.tensor(garbage, dtype=torch.float64)
                                      ).to(dtype)
    return batch


def _objective(name: str, kl: str | None, entropy_coef: float) -> TokenObjective:
    return TokenObjective(LOSSES[name], kl_coef=0.1 if kl else 0.0, kl_estimator=kl or "k3",
                          entropy_coef=entropy_coef)


def _both_paths(batch: PackedBatch, objective: TokenObjective, mode: str):
    """The trainer's micro-batch loss by autograd (its value, gradients, statistics) and the
    closed form of the same micro-batch (one micro-batch: the whole step)."""
    w = step_weights(mode, batch.loss_mask, batch.seq_index(), batch.num_seqs, norm_tokens=8)
    batch.fields[objmod.AGG_NUMERATOR] = w.numerator
    (mb,) = list(batch.micro_batches(10 ** 6))
    logp = mb.fields["logprobs"].clone().requires_grad_(True)
    ent = mb.fields["entropy"].clone().requires_grad_(True)
    loss, stats = objmod.micro_batch_loss(mb, logp, ent, objective, w.divisor, PROXIMAL)
    loss.backward()
    closed = objmod.closed_form(mb, mb.fields["logprobs"], mb.fields["entropy"], objective, w.divisor, PROXIMAL)
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (logp, ent)]  # None: no dependence
    return mb, w.divisor, loss.detach(), *grads, stats, closed


def _masked(logprobs, entropy, x: TokenInputs, slr):
    """The inputs with 0 on masked tokens (for the scales only: what the paths do there is
    checked, not assumed)."""
    def keep(t):
        return None if t is None else torch.where(x.mask, t, torch.zeros_like(t))

    x = dataclasses.replace(x, old_logprobs=keep(x.old_logprobs), rollout_logprobs=keep(x.rollout_logprobs),
                            advantages=keep(x.advantages), weights=keep(x.weights), correction=keep(x.correction),
                            ref_logprobs=keep(x.ref_logprobs))
    return keep(logprobs), keep(entropy), x, keep(slr)


def _grad_part_sizes(loss, lp, x, dpg):
    """``|∂pg/∂logp|`` as the sum of the sizes of its additive parts where it is a sum (KL-Cov's
    ``−A·r + κ·sign``, DRO's ``−A + β·d``): rounding is relative to the parts, not to what is
    left after they cancel."""
    lr = torch.where(x.mask, lp - x.old_logprobs, 0.0).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
    size_a = x.advantages.abs()
    if isinstance(loss, KLCov):
        return size_a * torch.exp(lr) + loss.ppo_kl_coef
    if isinstance(loss, DRO):
        return size_a + loss.beta * lr.abs()
    return dpg.abs()


def _term_scales(mb, objective: TokenObjective, divisor: float):
    """Per token, in float64: ``|w|·(|c·pg| + β|kl| + α|H|)`` and ``|w|·(|c|·|∂pg| + β|∂kl| + α)``
    with each derivative's additive parts counted apart (k3's ``1 − e^d`` as ``1 + e^d``): the
    sizes of what both paths add, the scale of their rounding differences."""
    x = objmod.token_inputs(mb, PROXIMAL, divisor, with_ref=objective.kl_coef > 0)
    slr = objmod.seq_log_ratio(mb, mb.fields["logprobs"], x) if objective.loss.sequence_level else None
    with torch.no_grad():
        lp, ent, x, slr = _masked(mb.fields["logprobs"], mb.fields["entropy"], x, slr)
        pg, dpg = objective.loss.grad(lp, x, slr)
        c = x.correction.to(pg.dtype).abs() if x.correction is not None else torch.ones_like(pg)
        value = (c * pg.abs()).double() + objective.entropy_coef * ent.abs().double()
        grad = (c * _grad_part_sizes(objective.loss, lp, x, dpg)).double() + objective.entropy_coef
        if x.ref_logprobs is not None:
            kl, dkl = kl_value_and_grad(lp, x.ref_logprobs, objective.kl_estimator)
            if objective.kl_estimator.rstrip("+") in ("k3", "low_var_kl") and not objective.kl_estimator.endswith("+"):
                d = (x.ref_logprobs.to(lp.dtype) - lp).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
                dkl = 1.0 + torch.exp(d)
            value, grad = value + objective.kl_coef * kl.abs().double(), grad + objective.kl_coef * dkl.abs().double()
        w = x.weights.to(torch.float64).abs()
        return torch.where(x.mask, w * value, 0.0), torch.where(x.mask, w * grad, 0.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=responses(), name=st.sampled_from(sorted(LOSSES)), dtype=st.sampled_from(sorted(UNIT_ROUNDOFF, key=str)),
       kl=st.sampled_from([None, *KL_ESTIMATORS]), entropy_coef=st.sampled_from([0.0, 0.01]),
       correction=st.booleans(), mode=st.sampled_from(LOSS_AGGREGATIONS))
def test_every_loss_is_finite_and_both_paths_agree_at_extremes(drawn, name, dtype, kl, entropy_coef, correction, mode):
    """The loss, its gradients and its statistics are finite; masked tokens get exactly 0 from
    both paths; autograd and the closed form agree within ``16·u·scale`` per token's gradient
    and ``(16 + T)·u·Σ scale`` for the loss, ``u`` the dtype's unit roundoff and ``scale`` the
    magnitudes of the terms added (each path rounds each term a few times: weights, correction,
    chain rule, the sum of up to three terms; the loss also sums T tokens). In bfloat16 that is
    ~6 % of the largest term: it holds the paths to the same branch and clamp decisions, where a
    wrong one would differ by the whole term."""
    batch = _batch(drawn, dtype, correction)
    objective = _objective(name, kl, entropy_coef)
    mb, divisor, loss, d_logp, d_ent, stats, closed = _both_paths(batch, objective, mode)
    where = f"{name} {dtype} kl={kl} α={entropy_coef} correction={correction} {mode}"
    tensors = {"loss": loss, "d_logp": d_logp, "d_entropy": d_ent, "closed value": closed.value,
               "closed d_logp": closed.d_logprobs, "closed d_entropy": closed.d_entropy}
    for what, t in tensors.items():
        assert bool(torch.isfinite(t).all()), f"{where}: {what} not finite: {t.tolist()}"
    assert all(math.isfinite(v) for v in stats.values()), f"{where}: statistics {stats}"
    off = ~mb.loss_mask
    for what, t in (("d_logp", d_logp), ("d_entropy", d_ent), ("closed d_logp", closed.d_logprobs),
                    ("closed value", closed.value)):
        assert bool((t[off] == 0).all()), f"{where}: {what} nonzero on masked tokens"
    u = UNIT_ROUNDOFF[dtype]
    subnormal = 16 * torch.finfo(dtype).tiny  # below the smallest normal number rounding is absolute
    value_scale, grad_scale = _term_scales(mb, objective, divisor)
    allowed = 16 * u * grad_scale + subnormal
    gap = (d_logp.double() - closed.d_logprobs.double()).abs()
    assert bool((gap <= allowed).all()), f"{where}: d_logp autograd {d_logp.tolist()} vs closed {closed.d_logprobs.tolist()}"
    gap_h = (d_ent.double() - closed.d_entropy.double()).abs()
    assert bool((gap_h <= allowed).all()), f"{where}: d_entropy {d_ent.tolist()} vs {closed.d_entropy.tolist()}"
    total_tol = (16 + mb.num_tokens) * u * float(value_scale.sum()) + mb.num_tokens * subnormal
    assert abs(float(loss) - float(closed.value.double().sum())) <= total_tol, f"{where}: loss {float(loss)} vs " \
        f"{float(closed.value.double().sum())}"


def _inputs(old, adv, mask=None, dtype=torch.float32):
    old = torch.tensor(old, dtype=dtype)
    n = old.numel()
    mask = torch.ones(n, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return TokenInputs(old_logprobs=old, rollout_logprobs=old, advantages=torch.tensor(adv, dtype=dtype), mask=mask,
                       weights=mask.to(dtype), correction=None, ref_logprobs=None,
                       seq_index=torch.zeros(n, dtype=torch.long), seq_tokens=mask.sum().clamp_min(1).to(dtype)[None])


def _autograd(loss, logp, x, slr=None):
    lp = torch.tensor(logp, dtype=x.old_logprobs.dtype, requires_grad=True)
    v = TokenObjective(loss).value(lp, None, x, slr)
    v.sum().backward()
    return v.detach(), lp.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gspo_sequence_ratio_is_clamped_above_as_verl(dtype):
    """A < 0 and a sequence log-ratio of 30 (or +inf, a rollout log-prob of −inf): GSPO's value
    is −A·e^10 (verl's clamp), its gradient 0 past it, finite by autograd and in closed form."""
    for srl in (30.0, math.inf):
        x = _inputs([-30.5, -0.5], [-1.0, -1.0], dtype=dtype)
        s = torch.full((2,), srl, dtype=dtype)
        v, g = _autograd(GSPO(), [-0.5, -0.5], x, s)
        assert v.tolist() == pytest.approx([math.exp(SEQ_LOG_RATIO_MAX)] * 2, rel=1e-2)
        closed = TokenObjective(GSPO()).closed_form(torch.tensor([-0.5, -0.5], dtype=dtype), None, x, s)
        assert g.tolist() == [0.0, 0.0] and closed.d_logprobs.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("rollout", [-100.0, -math.inf])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_rollout_log_prob_of_minus_100_or_inf_gives_finite_equal_gradients_in_float32(name, rollout):
    """The issue's case: one token's rollout log-prob is −100 (e^99.5 overflows float32) or −inf,
    both advantage signs and zero; loss and gradient are finite and equal on both paths."""
    loss = LOSSES[name]
    for adv in (1.5, -1.5, 0.0):
        x = _inputs([rollout, -1.2, -0.7], [adv, adv, adv])
        slr = None
        if loss.sequence_level:
            slr = torch.full((3,), float((torch.tensor([-0.5, -1.0, -0.9]) - x.old_logprobs).mean()))
        v, g = _autograd(loss, [-0.5, -1.0, -0.9], x, slr)
        closed = TokenObjective(loss).closed_form(torch.tensor([-0.5, -1.0, -0.9]), None, x, slr)
        assert bool(torch.isfinite(v).all() and torch.isfinite(g).all()), (name, adv, v, g)
        assert closed.value.tolist() == pytest.approx(v.tolist(), rel=1e-6, abs=1e-6), (name, adv)
        assert closed.d_logprobs.tolist() == pytest.approx(g.tolist(), rel=1e-6, abs=1e-6), (name, adv)
