"""More policy losses, each with its value and its derivative w.r.t. the token's log-prob in closed
form (the :class:`~rlcore.algorithms.spec.PolicyLoss` contract): SAPO, GPG, Clip-Cov, KL-Cov,
GMPO and DPPO (binary TV and binary KL). Notation as core's (:mod:`rlcore.algorithms`):
``r_t = exp(logp_t − old_t)``, ``A_t`` the advantage. Each class names its paper and the verl
function (``verl/trainer/ppo/core_algos.py``) whose formula it reproduces; docs/algorithms.md
lists the formulas and where rlcore's definition differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlcore.algorithms import LOG_RATIO_BOUND, bounded_log_ratio, clip_branch, log_ratio

#: log-ratios are clamped to ±this before ``exp`` in every loss here (verl clamps them in SAPO
#: and DPPO; rlcore in Clip-Cov, KL-Cov, GMPO and DRO too, where verl's can overflow)
RATIO_LOG_BOUND = LOG_RATIO_BOUND


def _adv(logprobs, x):
    return x.advantages.to(logprobs.device, logprobs.dtype)


def _zero_masked(t, x):
    return torch.where(x.mask, t, torch.zeros_like(t))


def _behaviour_metrics(logprobs, x, clipped: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    lr = bounded_log_ratio(logprobs, x)[0]
    out = {"ratio": torch.exp(lr), "approx_kl_behaviour": -lr}
    if clipped is not None:
        out["clipfrac"] = (clipped & x.mask).to(logprobs.dtype)
    return out


@dataclass(frozen=True)
class SAPO:
    """Soft Adaptive Policy Optimization: a smooth gate instead of a hard clip,
    ``pg_t = −A·(4/τ)·σ(τ(r − 1))`` with ``τ = τ_pos`` where ``A > 0``, else ``τ_neg``;
    ``∂pg_t/∂logp_t = −A·4σ(1−σ)·r`` (= ``−A`` at ``r = 1``), 0 where ``|log r| > 20``.

    Source: "Soft Adaptive Policy Optimization" (2025, arXiv:2511.20347); verl
    ``compute_policy_loss_sapo`` (τ_pos 1.0, τ_neg 1.05, log-ratio clamped to ±20,
    seq-mean-token-mean).
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    sequence_level: bool = False

    def _parts(self, logprobs, x):
        adv = _adv(logprobs, x)
        lr = log_ratio(logprobs, x)
        ratio = torch.exp(lr.clamp(-RATIO_LOG_BOUND, RATIO_LOG_BOUND))
        tau = torch.where(adv > 0, torch.full_like(adv, self.tau_pos), torch.full_like(adv, self.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0))
        return adv, lr, ratio, tau, gate

    def value(self, logprobs, x, seq_log_ratio=None):
        adv, _, _, tau, gate = self._parts(logprobs, x)
        return -adv * (4.0 / tau) * gate

    def grad(self, logprobs, x, seq_log_ratio=None):
        with torch.no_grad():
            adv, lr, ratio, tau, gate = self._parts(logprobs, x)
            inside = (lr.abs() <= RATIO_LOG_BOUND) & x.mask
            d = torch.where(inside, -adv * 4.0 * gate * (1.0 - gate) * ratio, torch.zeros_like(ratio))
            return -adv * (4.0 / tau) * gate, d

    def metrics(self, logprobs, x, seq_log_ratio=None):
        return _behaviour_metrics(logprobs, x)


@dataclass(frozen=True)
class GPG:
    """Group Policy Gradient's loss: plain REINFORCE on the log-prob, no ratio, no clip:
    ``pg_t = −A·logp_t``, ``∂pg_t/∂logp_t = −A``.

    Source: "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning"
    (2025, arXiv:2504.02546); verl ``compute_policy_loss_gpg``.
    """

    sequence_level: bool = False

    def value(self, logprobs, x, seq_log_ratio=None):
        return -_adv(logprobs, x) * _zero_masked(logprobs, x)

    def grad(self, logprobs, x, seq_log_ratio=None):
        adv = _adv(logprobs, x)
        return -adv * _zero_masked(logprobs, x), _zero_masked(-adv, x)

    def metrics(self, logprobs, x, seq_log_ratio=None):
        return _behaviour_metrics(logprobs, x)


def _centred_covariance(logprobs, x) -> torch.Tensor:
    """``(A_t − mean A)·(logp_t − mean logp)`` over the loss tokens the loss sees (detached;
    ``−inf`` elsewhere), the per-token covariance term of arXiv:2505.22617."""
    with torch.no_grad():
        adv = _adv(logprobs, x)
        m = x.mask
        n = max(int(m.sum()), 1)
        a_mean = (adv * m).sum() / n
        lp_mean = (_zero_masked(logprobs, x)).sum() / n
        cov = (adv - a_mean) * (logprobs - lp_mean)
        return torch.where(m, cov, torch.full_like(cov, -torch.inf))


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool mask of the ``k`` largest finite ``scores`` (ties: the earlier token)."""
    finite = torch.isfinite(scores)
    k = min(k, int(finite.sum()))
    out = torch.zeros_like(finite)
    if k > 0:
        idx = torch.argsort(torch.where(finite, scores, torch.full_like(scores, -torch.inf)), descending=True,
                            stable=True)[:k]
        out[idx] = True
    return out


@dataclass(frozen=True)
class ClipCov:
    """Clip-Cov: PPO-clip (no dual-clip) whose tokens with a large covariance between advantage
    and log-prob lose their gradient. Among the loss tokens not already clipped by PPO whose
    ``cov_t = (A_t − mean A)(logp_t − mean logp)`` lies in ``(lb, ub)``, the
    ``max(1, ⌊ratio·N⌋)`` largest are dropped: ``pg_t = max(−A r, −A clip(r))·(1 − 1[t sel])``.
    The means and ``N`` are over the tokens one call sees (a micro-batch, as verl's per
    micro-batch call); verl picks the dropped tokens at random among the candidates, rlcore
    takes the largest covariances (deterministic, so that ``value`` and ``grad`` agree). The
    log-ratio is clamped to ±20 as PPO-clip's (verl's Clip-Cov does not clamp it).

    Source: "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
    (2025, arXiv:2505.22617), Clip-Cov; verl ``compute_policy_loss_clip_cov``
    (ratio 2e-4, lb 1, ub 5).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    sequence_level: bool = False

    def _selected(self, logprobs, x, adv, ratio):
        with torch.no_grad():
            pg1 = -adv * ratio
            pg2 = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            cov = _centred_covariance(logprobs, x)
            band = (cov > self.clip_cov_lb) & (cov < self.clip_cov_ub) & ~(pg2 > pg1) & x.mask
            k = max(int(self.clip_cov_ratio * int(x.mask.sum())), 1)
            return _top(torch.where(band, cov, torch.full_like(cov, -torch.inf)), k)

    def value(self, logprobs, x, seq_log_ratio=None):
        adv = _adv(logprobs, x)
        ratio = torch.exp(bounded_log_ratio(logprobs, x)[0])
        pg = clip_branch(adv, ratio, self.clip_low, self.clip_high, 0.0)[0]
        sel = self._selected(logprobs, x, adv, ratio.detach())
        return torch.where(sel, torch.zeros_like(pg), pg)

    def grad(self, logprobs, x, seq_log_ratio=None):
        with torch.no_grad():
            adv = _adv(logprobs, x)
            lr, inside = bounded_log_ratio(logprobs, x)
            ratio = torch.exp(lr)
            pg, _, flows, _ = clip_branch(adv, ratio, self.clip_low, self.clip_high, 0.0)
            sel = self._selected(logprobs, x, adv, ratio)
            return (torch.where(sel, torch.zeros_like(pg), pg),
                    torch.where(flows & inside & x.mask & ~sel, -adv * ratio, torch.zeros_like(ratio)))

    def metrics(self, logprobs, x, seq_log_ratio=None):
        adv = _adv(logprobs, x)
        ratio = torch.exp(bounded_log_ratio(logprobs, x)[0])
        return _behaviour_metrics(logprobs, x, self._selected(logprobs, x, adv, ratio))


@dataclass(frozen=True)
class KLCov:
    """KL-Cov: the policy gradient ``−A·r`` (no clip), plus ``κ·|logp − old|`` on the
    ``max(1, ⌊ratio·N⌋)`` loss tokens with the largest covariance ``(A_t − mean A)(logp_t −
    mean logp)`` (over the tokens one call sees, as verl's per micro-batch call):
    ``∂pg_t/∂logp_t = −A·r + κ·sign(logp − old)·1[t sel]``; the log-ratio clamped to ±20
    (verl's is not, so its ``e^{logp − old}`` overflows at a rollout log-prob of −100 in float32).

    Source: arXiv:2505.22617 (as Clip-Cov), KL-Cov; verl ``compute_policy_loss_kl_cov``
    (ratio 2e-4; κ = 1 is core_algos' fallback, verl's config default ``ppo_kl_coef`` is 0.1).
    """

    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 1.0
    sequence_level: bool = False

    def _selected(self, logprobs, x):
        k = max(int(self.kl_cov_ratio * int(x.mask.sum())), 1)
        return _top(_centred_covariance(logprobs, x), k)

    def value(self, logprobs, x, seq_log_ratio=None):
        adv = _adv(logprobs, x)
        lr = bounded_log_ratio(logprobs, x)[0]
        sel = self._selected(logprobs, x)
        return -adv * torch.exp(lr) + torch.where(sel, self.ppo_kl_coef * lr.abs(), torch.zeros_like(lr))

    def grad(self, logprobs, x, seq_log_ratio=None):
        with torch.no_grad():
            adv = _adv(logprobs, x)
            lr, inside = bounded_log_ratio(logprobs, x)
            ratio = torch.exp(lr)
            sel = self._selected(logprobs, x)
            kl = torch.where(sel, self.ppo_kl_coef * lr.abs(), torch.zeros_like(lr))
            dkl = torch.where(sel, self.ppo_kl_coef * torch.sign(lr), torch.zeros_like(lr))
            d = torch.where(inside, -adv * ratio + dkl, torch.zeros_like(ratio))
            return -adv * ratio + kl, _zero_masked(d, x)

    def metrics(self, logprobs, x, seq_log_ratio=None):
        return _behaviour_metrics(logprobs, x, self._selected(logprobs, x))


@dataclass(frozen=True)
class GMPO:
    """Geometric-Mean Policy Optimization: the sequence's ratio is the geometric mean of its
    token ratios, each log-ratio clipped on the side the advantage favours:
    ``ĉ_t = sgn(A)·min(sgn(A)·d_t, sgn(A)·clip(d_t, −ε_l, ε_h))``, ``d_t = logp_t − old_t``,
    ``R_i = exp(mean_{t∈i} ĉ_t)``, sequence loss ``−A_i·R_i``. Per token (GMPO-token, as GSPO's):
    ``pg_t = −A_t·R_i`` with ``∂pg_t/∂logp_t = −A_t·R_i·1[ĉ_t = d_t]``; with
    ``seq-mean-token-mean`` (its default) the step loss is ``(1/B)·Σ_i −A_i·R_i`` and its
    gradient exactly that of the sequence objective (a sequence-level advantage, as verl assumes).
    ``d_t`` is clamped to ±20 first (verl leaves the clamp commented out: a rollout log-prob of
    −inf gives ``R_i = inf`` where ``A < 0``).

    Source: "Geometric-Mean Policy Optimization" (2025, arXiv:2507.20673);
    verl ``compute_policy_loss_geo_mean`` (clip ranges in log space, the paper's (−0.4, 0.4)).
    """

    clip_low: float = 0.4
    clip_high: float = 0.4
    sequence_level: bool = True

    def _clipped(self, logprobs, x):
        adv = _adv(logprobs, x)
        d, inside = bounded_log_ratio(logprobs, x)
        sgn = torch.sign(adv)
        c = sgn * torch.minimum(sgn * d, sgn * d.clamp(-self.clip_low, self.clip_high))
        return adv, d, c, inside

    def _seq_mean(self, c, x):
        nseq = x.seq_tokens.shape[0]
        s = torch.zeros(nseq, dtype=c.dtype, device=c.device).index_add_(0, x.seq_index, _zero_masked(c, x))
        return (s / x.seq_tokens.to(c.dtype))[x.seq_index]

    def value(self, logprobs, x, seq_log_ratio=None):
        adv, _, c, _ = self._clipped(logprobs, x)
        m = self._seq_mean(c.detach(), x)
        # value R_i, derivative w.r.t. logp_t: R_i·∂ĉ_t/∂logp_t (the token's own term); (c − sg[c])
        # is exactly 0, so the value is R_i to the bit in any dtype
        return -adv * torch.exp(m + (c - c.detach()))

    def grad(self, logprobs, x, seq_log_ratio=None):
        with torch.no_grad():
            adv, d, c, inside = self._clipped(logprobs, x)
            big_r = torch.exp(self._seq_mean(c, x))
            flows = (c == d) & inside & (adv != 0) & x.mask
            return -adv * big_r, torch.where(flows, -adv * big_r, torch.zeros_like(big_r))

    def metrics(self, logprobs, x, seq_log_ratio=None):
        _, d, c, _ = self._clipped(logprobs, x)
        return _behaviour_metrics(logprobs, x, c != d)


@dataclass(frozen=True)
class DPPO:
    """Divergence PPO (binary approximations): REINFORCE with a truncated, detached ratio on the
    tokens inside a divergence trust region, ``pg_t = −A·sg(min(r, c))·logp_t·v_t``,
    ``∂pg_t/∂logp_t = −A·min(r, c)·v_t``, ``v_t`` a detached mask:

    * ``tv``: ``p − p_old ≤ δ_h`` where ``A > 0``, ``p − p_old ≥ −δ_l`` otherwise
      (``p = e^{logp}``);
    * ``kl``: ``KL_bin = p_old·log(p_old/p) + (1−p_old)·log((1−p_old)/(1−p)) ≤ δ_h`` or
      ``p ≤ p_old`` where ``A > 0``; ``≤ δ_l`` or ``p ≥ p_old`` otherwise.

    Source: "Rethinking the Trust Region in LLM Reinforcement Learning" (2026,
    arXiv:2602.04879); verl ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` (``clip_ratio_c`` c
    = 20, log-ratio clamped to ±20, 1e-8 inside the binary KL's logarithm).
    """

    divergence: str = "tv"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 20.0
    sequence_level: bool = False

    def _weight(self, logprobs, x):
        with torch.no_grad():
            adv = _adv(logprobs, x)
            lr = log_ratio(logprobs, x).clamp(-RATIO_LOG_BOUND, RATIO_LOG_BOUND)
            trunc = torch.exp(lr).clamp(max=self.clip_ratio_c)
            # masked tokens hold garbage: evaluate the region at log-prob −1 there (kept finite)
            lp = torch.where(x.mask, logprobs, torch.full_like(logprobs, -1.0)).clamp(max=0.0)
            old = torch.where(x.mask, x.old_logprobs.to(lp.dtype), torch.full_like(lp, -1.0)).clamp(max=0.0)
            p, p_old = torch.exp(lp), torch.exp(old)
            if self.divergence == "tv":
                valid = torch.where(adv > 0, p - p_old <= self.clip_high, p - p_old >= -self.clip_low)
            else:
                bkl = p_old * (old - lp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
                valid = torch.where(adv > 0, (bkl <= self.clip_high) | (p <= p_old),
                                    (bkl <= self.clip_low) | (p >= p_old))
            return adv, trunc * (valid & x.mask).to(trunc.dtype), valid

    def value(self, logprobs, x, seq_log_ratio=None):
        adv, w, _ = self._weight(logprobs, x)
        return -adv * w * _zero_masked(logprobs, x)

    def grad(self, logprobs, x, seq_log_ratio=None):
        adv, w, _ = self._weight(logprobs, x)
        return -adv * w * _zero_masked(logprobs, x), _zero_masked(-adv * w, x)

    def metrics(self, logprobs, x, seq_log_ratio=None):
        _, _, valid = self._weight(logprobs, x)
        return _behaviour_metrics(logprobs, x, ~valid)


@dataclass(frozen=True)
class DRO:
    """DRO's policy loss: REINFORCE with a quadratic penalty on the log-ratio to the sampling
    policy, ``pg_t = −A·logp_t + (β/2)·(logp_t − old_t)²``, ``∂pg_t/∂logp_t = −A + β·(logp_t −
    old_t)`` (= ``−A`` at the proximal policy).

    Source: the ``dro`` loss of Thinking Machines' Tinker (its loss-function reference: objective
    ``logp·A − ½β(logp − logp_sampling)²``, β 1); after Richemond et al. 2024, "Offline
    Regularised Reinforcement Learning for Large Language Models Alignment" (arXiv:2405.19107),
    Direct Reward Optimization; verl 0.9.1 ``compute_policy_loss_dro`` (``dro_beta``, required
    > 0 there). ``logp_t − old_t`` is clamped to ±20 (verl's is not: a rollout log-prob of −inf
    gives an infinite loss), so the penalty is at most ``200·β`` and pulls no further past it.
    """

    beta: float = 1.0
    sequence_level: bool = False

    def value(self, logprobs, x, seq_log_ratio=None):
        d = bounded_log_ratio(logprobs, x)[0]
        return -_adv(logprobs, x) * _zero_masked(logprobs, x) + 0.5 * self.beta * d.square()

    def grad(self, logprobs, x, seq_log_ratio=None):
        adv = _adv(logprobs, x)
        d, inside = bounded_log_ratio(logprobs, x)
        return (-adv * _zero_masked(logprobs, x) + 0.5 * self.beta * d.square(),
                _zero_masked(-adv + torch.where(inside, self.beta * d, torch.zeros_like(d)), x))

    def metrics(self, logprobs, x, seq_log_ratio=None):
        return _behaviour_metrics(logprobs, x)
