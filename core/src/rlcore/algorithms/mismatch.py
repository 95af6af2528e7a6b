"""Rollout–trainer mismatch: the rollout engine samples with log-probs ``q_t`` that differ from
the trainer's ``p_t`` for the same weights (kernels, precision, MoE routing). Policy-gradient
terms are importance-weighted by ``ρ = p/q``, truncated (TIS) and/or masked past thresholds, at
token or sequence level; the mismatch is measured every step whether or not it is corrected.

Sources: Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (blog; truncated importance sampling ``min(p/q, C)`` at token level); Liu, Li et al.
2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch" (blog; sequence-level IS and masking sequences whose ratio leaves a trust region).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class MismatchCorrection:
    """``level``: ``token`` (``ρ_t = exp(p_t − q_t)``), ``sequence`` (``ρ_i = exp(Σ_t p_t −
    q_t)``, the product over the sequence) or ``geometric`` (``exp(mean_t …)``, length
    independent); a sequence-level ρ applies to every token of the sequence.
    ``tis_cap`` > 0: weight ``min(ρ, tis_cap)``; ``mask_low``/``mask_high`` > 0: weight 0
    where ``ρ < mask_low`` / ``ρ > mask_high``. ``reject`` (one of
    :data:`rlcore.algorithm_settings.REJECT_STATS`, e.g. ``seq_max_k3``): weight 0 for every
    token of a sequence whose statistic exceeds ``reject_max`` (k1 statistics: in absolute
    value), on top of the above."""

    level: str = "token"
    tis_cap: float = 0.0
    mask_low: float = 0.0
    mask_high: float = 0.0
    reject: str = ""
    reject_max: float = 0.0

    @classmethod
    def from_config(cls, mm) -> MismatchCorrection:
        """From the ``algorithm.mismatch`` config section."""
        return cls(mm.level, float(mm.tis_cap), float(mm.mask_low), float(mm.mask_high), str(mm.reject),
                   float(mm.reject_max))

    @property
    def active(self) -> bool:
        return self.tis_cap > 0 or self.mask_low > 0 or self.mask_high > 0 or bool(self.reject)

    @property
    def per_token(self) -> bool:
        """Whether each token's weight depends on that token alone (token level, no sequence
        rejection): what lets a head compute the weights chunk by chunk from its own log-probs
        (``algorithm.old_logprobs: current``)."""
        return not self.active or (self.level == "token" and not self.reject)


def token_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                  cfg: MismatchCorrection) -> torch.Tensor | None:
    """``[T]`` float32 correction weights of a :attr:`MismatchCorrection.per_token` correction
    (``None`` when it is off): ``min(ρ_t, tis_cap)``, 0 where ``ρ_t`` leaves ``[mask_low,
    mask_high]`` and on tokens outside ``mask``; :func:`mismatch` gives the same weights for the
    whole step."""
    if not cfg.active:
        return None
    if not cfg.per_token:
        raise ValueError(f"mismatch correction at level {cfg.level!r} (reject {cfg.reject!r}) is not per token")
    d = torch.where(mask, trainer_logprobs.double() - rollout_logprobs.double(), torch.zeros_like(trainer_logprobs,
                                                                                                  dtype=torch.float64))
    rho = torch.exp(d)
    weight = rho.clamp(max=cfg.tis_cap) if cfg.tis_cap > 0 else torch.ones_like(rho)
    masked = torch.zeros_like(mask)
    if cfg.mask_low > 0:
        masked |= rho < cfg.mask_low
    if cfg.mask_high > 0:
        masked |= rho > cfg.mask_high
    return torch.where(masked | ~mask, torch.zeros_like(weight), weight).to(torch.float32)


@dataclass
class MismatchResult:
    correction: torch.Tensor | None  #: ``[T]`` weights (None: correction off)
    metrics: dict[str, float]


def _seq_reduce(x: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq_index, x)


#: |log ρ| is clamped to this before the rejection statistics (verl's SAFETY_BOUND), so that they
#: stay finite (k3 ≤ e^20): a sequence with a token past it is rejected by any k2/k3 threshold
LOG_RATIO_BOUND = 20.0


def rejection_statistic(d: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int,
                        stat: str) -> torch.Tensor:
    """``[B]``: the per-sequence ``sum``/``mean``/``max`` (``stat`` ``seq_<reduce>_<k>``) of the
    per-token k1 ``−d``, k2 ``d²/2`` or k3 ``e^d − 1 − d`` of KL(rollout‖trainer), ``d = log ρ``
    clamped to ±:data:`LOG_RATIO_BOUND`, over loss tokens (0 for a sequence without any); k1
    statistics are returned in absolute value. As verl's ``compute_rollout_rejection_mask``
    (``rollout_corr_helper.py``), whose k1 thresholds are ratios (``exp`` of ours)."""
    _, reduce, k = stat.split("_")
    d = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    per_token = {"k1": -d, "k2": 0.5 * d.square(), "k3": torch.exp(d) - 1.0 - d}[k]
    mf = mask.to(per_token.dtype)
    if reduce == "max":
        filled = torch.where(mask, per_token, torch.full_like(per_token, -torch.inf))
        out = torch.full((num_seqs,), -torch.inf, dtype=per_token.dtype, device=d.device)
        out = out.scatter_reduce(0, seq_index, filled, reduce="amax")
        out = torch.where(torch.isfinite(out), out, torch.zeros_like(out))
    else:
        out = _seq_reduce(per_token * mf, seq_index, num_seqs)
        if reduce == "mean":
            out = out / _seq_reduce(mf, seq_index, num_seqs).clamp_min(1.0)
    return out.abs() if k == "k1" else out


def mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
             seq_index: torch.Tensor, num_seqs: int, cfg: MismatchCorrection) -> MismatchResult:
    """Correction weights over the step's token axis and the step's mismatch metrics
    (``mismatch/*``): KL estimates of KL(rollout‖trainer) from the rollout's samples (k1:
    ``mean(q − p)``, k3: ``mean(ρ − 1 − log ρ)``), token and sequence ratio statistics, and the
    fractions truncated and masked."""
    m = mask
    mf = m.to(torch.float64)
    d = torch.where(m, trainer_logprobs.double() - rollout_logprobs.double(), torch.zeros_like(mf))
    n_tok = max(int(m.sum()), 1)
    rho_t = torch.exp(d)
    seq_sum = _seq_reduce(d, seq_index, num_seqs)
    seq_len = _seq_reduce(mf, seq_index, num_seqs)
    has = seq_len > 0
    seq_log = seq_sum if cfg.level != "geometric" else seq_sum / seq_len.clamp_min(1.0)
    rho_s = torch.exp(seq_log)
    tok_rho = rho_t[m]
    metrics = {
        "mismatch/kl_k1": float((-d).sum() / n_tok),
        "mismatch/kl_k3": float(((rho_t - 1.0 - d) * mf).sum() / n_tok),
        "mismatch/ratio_mean": float(tok_rho.mean()) if tok_rho.numel() else 1.0,
        "mismatch/ratio_std": float(tok_rho.std(unbiased=False)) if tok_rho.numel() else 0.0,
        "mismatch/ratio_min": float(tok_rho.min()) if tok_rho.numel() else 1.0,
        "mismatch/ratio_max": float(tok_rho.max()) if tok_rho.numel() else 1.0,
        "mismatch/seq_ratio_mean": float(rho_s[has].mean()) if bool(has.any()) else 1.0,
        "mismatch/seq_ratio_max": float(rho_s[has].max()) if bool(has.any()) else 1.0,
        "mismatch/abs_logprob_diff_max": float(d.abs().max()) if d.numel() else 0.0,
    }
    if not cfg.active:
        return MismatchResult(None, metrics)
    rho = rho_t if cfg.level == "token" else rho_s[seq_index]
    weight = rho.clone()
    truncated = torch.zeros_like(m)
    if cfg.tis_cap > 0:
        truncated = (rho > cfg.tis_cap) & m
        weight = weight.clamp(max=cfg.tis_cap)
    masked = torch.zeros_like(m)
    if cfg.mask_low > 0:
        masked |= rho < cfg.mask_low
    if cfg.mask_high > 0:
        masked |= rho > cfg.mask_high
    if cfg.reject:
        stat = rejection_statistic(d, m, seq_index, num_seqs, cfg.reject)
        rejected = stat > cfg.reject_max
        masked |= rejected[seq_index]
        metrics.update({
            "mismatch/rejected_seq_frac": float(rejected[has].double().mean()) if bool(has.any()) else 0.0,
            "mismatch/reject_stat_mean": float(stat[has].mean()) if bool(has.any()) else 0.0,
            "mismatch/reject_stat_max": float(stat[has].max()) if bool(has.any()) else 0.0,
        })
    masked &= m
    if cfg.tis_cap <= 0:  # masking only: the kept tokens keep weight 1 (rejection, not IS)
        weight = torch.ones_like(weight)
    weight = torch.where(masked, torch.zeros_like(weight), weight) * mf
    seq_masked = _seq_reduce(masked.to(torch.float64), seq_index, num_seqs) > 0
    metrics.update({
        "mismatch/truncated_frac": float(truncated.sum()) / n_tok,
        "mismatch/masked_frac": float(masked.sum()) / n_tok,
        "mismatch/masked_seq_frac": float(seq_masked[has].double().mean()) if bool(has.any()) else 0.0,
        "mismatch/weight_mean": float(weight[m].mean()) if bool(m.any()) else 1.0,
    })
    return MismatchResult(weight.to(torch.float32), metrics)
