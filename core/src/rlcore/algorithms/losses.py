"""Core's policy loss (PPO-clip, and the helpers other losses reuse) and core's per-token terms (KL to a reference, entropy bonus), each
with its value and its derivative with respect to the token's log-prob in closed form.

Notation per token ``t``: ``r_t = exp(logp_t − old_t)`` the importance ratio against the
proximal (old) policy, ``A_t`` the advantage, ``ε_l, ε_h`` the lower and upper clip ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.algorithms.spec import KL_ESTIMATORS, PolicyLoss, TokenInputs, TokenLoss

#: ``|logp − old|`` is clamped to this many nats before ``exp`` in every loss's token ratio
#: (verl's bound in PPO-clip, CISPO, SAPO and DPPO; rlcore applies it to every ratio, see
#: docs/algorithms.md): past it the ratio is constant, its gradient 0, and ``e^20·|A|`` bounds
#: the term in float32 and bfloat16 alike (a rollout log-prob of −100 or −inf stays finite)
LOG_RATIO_BOUND = 20.0


def log_ratio(logprobs: torch.Tensor, x: TokenInputs) -> torch.Tensor:
    """``logp − old`` on loss tokens (0 elsewhere), unbounded."""
    old = x.old_logprobs.to(logprobs.device, logprobs.dtype)
    return torch.where(x.mask, logprobs - old, torch.zeros_like(logprobs))


def bounded_log_ratio(logprobs: torch.Tensor, x: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``clamp(logp − old, ±LOG_RATIO_BOUND)`` on loss tokens (0 elsewhere), differentiable, and
    where it is inside the bound (bool: its derivative w.r.t. ``logp`` is 1 there, 0 elsewhere,
    as autograd through the clamp gives; a NaN or infinite log-ratio is outside)."""
    raw = log_ratio(logprobs, x)
    return raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), raw.abs() <= LOG_RATIO_BOUND


def clip_branch(adv: torch.Tensor, ratio: torch.Tensor, low: float, high: float, ratio_c: float):
    """PPO's pessimistic clipped surrogate and which branch is active: ``(pg, clipped ratio, where
    the gradient flows, where dual-clip is active)`` (shared by PPO-clip and rlcore-algorithms'
    GSPO and Clip-Cov, which differ only in what ``ratio`` is)."""
    unclipped = -adv * ratio
    clipped_ratio = ratio.clamp(1.0 - low, 1.0 + high)
    clipped = -adv * clipped_ratio
    pg = torch.maximum(unclipped, clipped)
    # the gradient flows only where the unclipped branch is (weakly) the maximum
    flows = unclipped >= clipped
    dual = None
    if ratio_c > 0:
        bound = -adv * ratio_c
        dual = (adv < 0) & (bound < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
        flows = flows & ~dual
    return pg, clipped_ratio, flows, dual


@dataclass(frozen=True)
class PPOClip:
    """PPO's clipped surrogate with asymmetric clipping and dual-clip.

    ``pg_t = max(−A·r, −A·clip(r, 1−ε_l, 1+ε_h))``, and for ``A < 0`` with dual-clip
    ``pg_t = min(pg_t, −A·c)``. ``∂pg_t/∂logp_t = −A·r`` where the unclipped branch is active,
    else 0. ``r`` is taken from the log-ratio clamped to ±:data:`LOG_RATIO_BOUND` (verl's), so
    without dual-clip the term is at most ``|A|·e^20`` and its gradient 0 past the clamp.

    Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7 (L^CLIP);
    asymmetric ranges ("clip-higher"): Yu et al. 2025, "DAPO", eq. 10; dual-clip: Ye et al.
    2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5 (``c = clip_ratio_c``,
    ``c > 1``; 0 turns it off).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 3.0
    sequence_level: bool = False

    def value(self, logprobs, x, seq_log_ratio=None):
        adv = x.advantages.to(logprobs.device, logprobs.dtype)
        ratio = torch.exp(bounded_log_ratio(logprobs, x)[0])
        return clip_branch(adv, ratio, self.clip_low, self.clip_high, self.clip_ratio_c)[0]

    def grad(self, logprobs, x, seq_log_ratio=None):
        adv = x.advantages.to(logprobs.device, logprobs.dtype)
        log_ratio, inside = bounded_log_ratio(logprobs, x)
        ratio = torch.exp(log_ratio)
        pg, _, flows, _ = clip_branch(adv, ratio, self.clip_low, self.clip_high, self.clip_ratio_c)
        return pg, torch.where(flows & inside & x.mask, -adv * ratio, torch.zeros_like(ratio))

    def metrics(self, logprobs, x, seq_log_ratio=None):
        adv = x.advantages.to(logprobs.device, logprobs.dtype)
        log_ratio = bounded_log_ratio(logprobs, x)[0]
        ratio = torch.exp(log_ratio)
        _, clipped, _, dual = clip_branch(adv, ratio, self.clip_low, self.clip_high, self.clip_ratio_c)
        out = {
            "clipfrac": (((ratio - clipped).abs() > 1e-6) & x.mask).to(ratio.dtype),
            "ratio": ratio,
            "approx_kl_behaviour": -log_ratio,
        }
        if dual is not None:
            out["dual_clipfrac"] = (dual & x.mask).to(ratio.dtype)
        return out


# ---------------------------------------------------------------------------------------------
# core's terms
# ---------------------------------------------------------------------------------------------

#: |ref − logp| is clamped to this many nats before any estimator (verl's bound for k3/low_var_kl;
#: rlcore bounds k1, k2 and the straight-through gradient too); beyond it the
#: token's KL term is constant (zero gradient)
KL_LOG_RATIO_BOUND = 20.0
#: k3's value is clamped to [0, this] (verl's ``low_var_kl`` bound); beyond it, zero gradient
K3_VALUE_BOUND = 10.0
#: the largest |value| each estimator can take (straight-through ``<est>+``: that of ``<est>``)
KL_VALUE_BOUND = {"k1": KL_LOG_RATIO_BOUND, "k2": 0.5 * KL_LOG_RATIO_BOUND ** 2, "k3": K3_VALUE_BOUND,
                  "low_var_kl": K3_VALUE_BOUND}
#: the largest |∂value/∂logp|: k1 1, k2 |d| ≤ 20, k3 |1 − e^d| where e^d − d − 1 ≤ 10 (d ≤ 2.6105,
#: so < 12.61); straight-through variants have k2's gradient
KL_GRAD_BOUND = {"k1": 1.0, "k2": KL_LOG_RATIO_BOUND, "k3": 12.61, "low_var_kl": 12.61,
                 "k1+": KL_LOG_RATIO_BOUND, "k3+": KL_LOG_RATIO_BOUND, "low_var_kl+": KL_LOG_RATIO_BOUND}


def _kl_terms(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str):
    """The bounded estimator's value (differentiable), its closed-form derivative w.r.t.
    ``logp`` and k2's (for the straight-through variants)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of: {', '.join(KL_ESTIMATORS)}")
    raw = ref_logprobs.to(logprobs.device, logprobs.dtype) - logprobs
    d = raw.clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    inside = ((raw >= -KL_LOG_RATIO_BOUND) & (raw <= KL_LOG_RATIO_BOUND)).to(d.dtype)
    k2_grad = (-d * inside).detach()
    base = estimator.rstrip("+")
    if base == "k1":
        return -d, inside.detach(), k2_grad
    if base == "k2":
        return 0.5 * d.square(), k2_grad, k2_grad
    e = torch.exp(d)
    k3 = e - d - 1.0  # >= 0
    value = k3.clamp(max=K3_VALUE_BOUND)
    grad = torch.where(k3 <= K3_VALUE_BOUND, (1.0 - e) * inside, torch.zeros_like(e)).detach()
    return value, grad, k2_grad


def kl_value_and_grad(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimate of KL(π‖π_ref) from the sampled token and its derivative w.r.t.
    ``logp`` in closed form (the value is differentiable too). With ``d = clamp(ref − logp, ±20)``: k1 ``−d`` (∂: 1), k2
    ``d²/2`` (∂: ``−d``), k3 = ``low_var_kl`` ``min(e^d − d − 1, 10)`` (∂: ``1 − e^d``, 0 where
    clamped); ``<est>+``: the value of ``<est>``, the derivative of k2 (straight-through: k2's
    gradient is the unbiased gradient of KL). Bounds: :data:`KL_VALUE_BOUND`,
    :data:`KL_GRAD_BOUND`. Source: J. Schulman, "Approximating KL Divergence" (2020); the
    straight-through form and k3's clamps as verl's ``kl_penalty`` (``core_algos.py``), which
    leaves k1, k2 and the straight-through k2 gradient unclamped."""
    value, grad, k2_grad = _kl_terms(logprobs, ref_logprobs, estimator)
    if not estimator.endswith("+"):
        return value, grad
    # straight-through: the value of the estimator, the gradient of k2 (differentiable as such)
    k2 = 0.5 * (ref_logprobs.to(logprobs.device, logprobs.dtype) - logprobs).clamp(
        -KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND).square()
    return k2 - k2.detach() + value.detach(), k2_grad


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """The value of :func:`kl_value_and_grad` (differentiable, with the same derivative)."""
    return kl_value_and_grad(logprobs, ref_logprobs, estimator)[0]


def masked_inputs(logprobs: torch.Tensor, entropy: torch.Tensor | None, x: TokenInputs,
                  seq_log_ratio: torch.Tensor | None = None):
    """``(logprobs, entropy, x, seq_log_ratio)`` with every per-token value set to 0 on the
    tokens ``x.mask`` excludes, where the head and the batch leave garbage (padding, prompts,
    ``-inf``, NaN). Done before any loss sees them, so no loss (a plugin's included) evaluates
    garbage, and no ``0·inf`` reaches a value or, through autograd, a gradient: a masked token's
    derivative is exactly 0 on both paths. On loss tokens nothing changes."""
    m = x.mask.to(logprobs.device)

    def keep(t):
        return None if t is None else torch.where(m.to(t.device), t, torch.zeros_like(t))

    x = TokenInputs(old_logprobs=keep(x.old_logprobs), rollout_logprobs=keep(x.rollout_logprobs),
                    advantages=keep(x.advantages), mask=x.mask, weights=keep(x.weights), correction=keep(x.correction),
                    ref_logprobs=keep(x.ref_logprobs), seq_index=x.seq_index, seq_tokens=x.seq_tokens)
    return keep(logprobs), keep(entropy), x, keep(seq_log_ratio)


@dataclass(frozen=True)
class TokenObjective:
    """The whole per-token objective ``w·(c·pg + β·kl − α·H)`` of :mod:`rlcore.algorithms.spec`,
    both as a differentiable value (``value``, the plain autograd path the trainer uses) and in
    closed form (``closed_form``, what a head that computes the loss gradient itself uses)."""

    loss: PolicyLoss
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def _unweighted(self, logprobs, entropy, x, seq_log_ratio):
        pg = self.loss.value(logprobs, x, seq_log_ratio)
        if x.correction is not None:
            pg = pg * x.correction.to(pg.device, pg.dtype)
        if x.ref_logprobs is not None and self.kl_coef > 0:
            pg = pg + self.kl_coef * kl_penalty(logprobs, x.ref_logprobs, self.kl_estimator)
        if self.entropy_coef:
            pg = pg - self.entropy_coef * self._entropy(entropy)
        return pg

    def _entropy(self, entropy):
        """The head's entropy, which an entropy bonus cannot do without (never dropped silently)."""
        if entropy is None:
            from rlcore.errors import MissingCapabilityError

            raise MissingCapabilityError(
                f"algorithm.entropy_coef={self.entropy_coef:g} needs the entropy of every token, but the "
                f"forward_fn returned none (HeadOutput.entropy is None); use a head that computes entropy "
                f"(capability 'entropy') or set algorithm.entropy_coef=0"
            )
        return entropy

    def value(self, logprobs, entropy, x: TokenInputs, seq_log_ratio=None) -> torch.Tensor:
        """``[T]`` per-token unweighted objective, 0 on masked tokens (multiply by the
        aggregation numerator and divide by its divisor to get the loss)."""
        logprobs, entropy, x, seq_log_ratio = masked_inputs(logprobs, entropy, x, seq_log_ratio)
        out = self._unweighted(logprobs, entropy, x, seq_log_ratio)
        return torch.where(x.mask, out, torch.zeros_like(out))

    def closed_form(self, logprobs, entropy, x: TokenInputs, seq_log_ratio=None) -> TokenLoss:
        """Value and derivatives, weighted by ``x.weights``, without autograd."""
        with torch.no_grad():
            logprobs, entropy, x, seq_log_ratio = masked_inputs(logprobs, entropy, x, seq_log_ratio)
            w = x.weights.to(logprobs.device, logprobs.dtype)
            pg, dpg = self.loss.grad(logprobs, x, seq_log_ratio)
            if x.correction is not None:
                c = x.correction.to(pg.device, pg.dtype)
                pg, dpg = pg * c, dpg * c
            if x.ref_logprobs is not None and self.kl_coef > 0:
                kl, dkl = kl_value_and_grad(logprobs, x.ref_logprobs, self.kl_estimator)
                pg, dpg = pg + self.kl_coef * kl, dpg + self.kl_coef * dkl
            d_ent = torch.zeros_like(pg)
            if self.entropy_coef:
                pg = pg - self.entropy_coef * self._entropy(entropy)
                d_ent = d_ent - self.entropy_coef
            zero = torch.zeros_like(pg)
            return TokenLoss(value=torch.where(x.mask, w * pg, zero), d_logprobs=torch.where(x.mask, w * dpg, zero),
                             d_entropy=torch.where(x.mask, w * d_ent, zero))
