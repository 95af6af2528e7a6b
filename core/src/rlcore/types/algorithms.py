"""The algorithm contract: what an ``algorithm`` provider registers and what core asks of it.

An algorithm is two things: an **advantage estimator** (per-sample rewards and groups, plus the
rollout's per-token data, to per-token advantages) and a **policy loss** stated per token in
closed form. Core owns everything around them: the aggregation weights, KL to a reference, the
entropy bonus and the rollout–trainer mismatch correction, so that every algorithm gets them
the same way and a fused head can evaluate the whole per-token objective in a kernel.

The per-token objective (one step, every micro-batch together)::

    L = Σ_t  w_t · ( c_t · pg_t(logp_t)  +  β · kl_t(logp_t)  −  α · H_t )

* ``w_t``  the aggregation weight (:mod:`rlcore.algorithms.aggregation`): known before the
  forward, zero on masked tokens (token-mean: ``1/N`` with ``N`` loss tokens in the step).
* ``c_t``  the mismatch-correction weight (truncated importance sampling between the trainer's
  and the rollout engine's log-probs; ``0`` for masked tokens or sequences; ``1`` when off).
* ``pg_t`` the algorithm's policy-gradient term (:class:`PolicyLoss`), a function of the
  token's log-prob given its old log-prob and advantage — for sequence-level losses (GSPO) also
  of the sequence's mean log-ratio, which then must be known before the derivative is formed.
* ``kl_t`` Schulman's k1/k2/k3 estimate of KL(π‖π_ref) at the sampled token, ``β`` its
  coefficient (0: off); ``H_t`` the token's entropy, ``α`` the entropy bonus.

Every term is an elementwise function of per-token scalars, so ``∂L/∂logp_t`` and
``∂L/∂H_t`` are elementwise too (:class:`TokenLoss`): that is what a head needs to form the
loss gradient in the same pass that computes the log-probs.

This module imports no torch at runtime (tensors appear in annotations only), so listing plugins
stays fast. Its names are importable from :mod:`rlcore.types` (the contracts) and
:mod:`rlcore.algorithms` (with the built-in implementations: :mod:`rlcore.algorithms.losses`,
:mod:`rlcore.algorithms.advantages`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlcore.types.providers import ProviderSpec

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch

#: aggregation modes core implements (weights in :mod:`rlcore.algorithms.aggregation`)
LOSS_AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "token-sum",
    "seq-mean-token-sum-norm",
)

#: ``algorithm.kl_estimator``: Schulman's k1/k2/k3 (``low_var_kl``: k3 under verl's name; all
#: bounded, rlcore.algorithms.losses) and the straight-through ``<est>+`` (value of ``<est>``,
#: gradient of k2)
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+")


@dataclass(frozen=True)
class AdvantageInput:
    """What an advantage estimator receives, once per step, after the no-grad passes.

    :param rewards: ``[N]`` float, one scalar reward per sample (the reward function's output,
        plus the summed per-token KL penalty when ``algorithm.kl_in: reward``).
    :param groups: ``[N]`` long, the prompt each sample answers (samples of one prompt form a
        group).
    :param token_rewards: per sample, ``[n_i]`` float over its response tokens: the outcome
        reward on the last token plus ``-β·kl_t`` on every token when the KL penalty is in the
        reward (token-level estimators such as REINFORCE++ use these; outcome estimators use
        ``rewards``).
    :param logprobs: per sample, ``[n_i]`` rollout (behaviour) log-probs of the response.
    :param values: per sample, ``[n_i]`` the critic's values at the response tokens, when the
        algorithm trains one (PPO: settings with a ``critic`` group); ``None`` otherwise.
    :param baseline_rewards: ``[N]`` float, per sample the reward of one greedy response to its
        prompt (ReMax's baseline); set only for an algorithm with ``Algorithm.greedy_baseline``.
    :param reward_components: ``{name: [N] float}``, each sample's value of each named component
        when the reward function returns a dict (their plain sum is ``rewards`` before any
        shaping; GDPO normalises each apart, :mod:`rlcore.rewards`); ``None`` for single values.
    :param recomputed_logprobs: per sample, ``[n_i]`` the trainer's own log-probs of the response
        from the old-log-prob pass (the policy that sampled, before this step's update, at the
        rollout temperature); ``None`` where a caller has not run that pass.
    :param sum_pi_squared: per sample, ``[n_i]`` ``Σ_v π(v)²`` over the whole vocabulary at each
        response token, from that same pass; set only for an algorithm whose spec lists
        ``Cap.SUM_PI_SQUARED`` in ``AlgorithmSpec.head_needs`` (the optimal-token baseline).
    :param correction: per sample, ``[n_i]`` the mismatch-correction weights ``c_t`` (truncated
        importance weights between the trainer and the rollout engine, 0 on rejected tokens)
        when ``algorithm.mismatch`` is on; ``None`` otherwise.
    """

    rewards: torch.Tensor
    groups: torch.Tensor
    token_rewards: Sequence[torch.Tensor]
    logprobs: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor] | None = None
    baseline_rewards: torch.Tensor | None = None
    reward_components: dict[str, torch.Tensor] | None = None
    recomputed_logprobs: Sequence[torch.Tensor] | None = None
    sum_pi_squared: Sequence[torch.Tensor] | None = None
    correction: Sequence[torch.Tensor] | None = None

    @property
    def response_lengths(self) -> list[int]:
        return [int(t.shape[0]) for t in self.token_rewards]


@runtime_checkable
class AdvantageEstimator(Protocol):
    """``estimator(inp) -> list of [n_i] per-token advantages``, one tensor per sample (in the
    order of ``inp.rewards``). Called once per step, without gradients."""

    def __call__(self, inp: AdvantageInput) -> list[torch.Tensor]: ...


@dataclass
class TokenInputs:
    """The per-token data of a micro-batch, all known before its train forward; every tensor is
    ``[T]`` on the token axis of :class:`rlcore.batch.PackedBatch` (label-aligned).

    :param old_logprobs: the proximal policy's log-probs, the ratio's denominator: the rollout
        engine's behaviour log-probs, or the trainer's own recomputation when
        ``algorithm.old_logprobs`` says so (always when mismatch correction is on).
    :param rollout_logprobs: the rollout engine's behaviour log-probs.
    :param advantages: per-token advantages.
    :param mask: bool, the tokens that carry loss.
    :param weights: the aggregation weights ``w_t`` (zero where ``mask`` is False).
    :param correction: ``c_t``, the mismatch-correction weights (``None``: no correction,
        i.e. all ones).
    :param ref_logprobs: the reference policy's log-probs (``None`` unless KL is a loss term).
    :param seq_index: ``[T]`` long, which sequence of the micro-batch each token belongs to.
    :param seq_tokens: ``[B]`` float, loss tokens per sequence (at least 1).
    """

    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    correction: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    seq_index: torch.Tensor
    seq_tokens: torch.Tensor


@dataclass
class TokenLoss:
    """The per-token objective in closed form: ``value`` ``[T]`` is ``w_t·(c_t·pg_t + β·kl_t −
    α·H_t)`` (so ``value.sum()`` is this micro-batch's share of the step loss),
    ``d_logprobs`` and ``d_entropy`` its derivatives with respect to the token's log-prob and
    entropy. Zero on masked tokens."""

    value: torch.Tensor
    d_logprobs: torch.Tensor
    d_entropy: torch.Tensor


@runtime_checkable
class PolicyLoss(Protocol):
    """A policy-gradient term, per token, with its derivative in closed form.

    ``sequence_level`` losses (GSPO) take the sequence's mean log-ratio
    ``ρ_i = mean_{t∈i}(logp_t − old_t)`` as ``seq_log_ratio`` (``[T]``, each token carrying
    its sequence's value; a stop-gradient quantity: the token's own dependence enters through
    ``logp_t``, as GSPO-token defines it). Token-level losses ignore it.

    Masking: on tokens where ``x.mask`` is False the batch holds garbage. Core's objective
    (``TokenObjective``) sets every input there to 0 before calling ``value``/``grad``/``metrics``
    and drops what they return there, so a masked token contributes exactly 0 on both paths;
    called directly (the conformance suite feeds garbage), a loss must still return finite values
    there (``0·inf`` is ``nan``): mask before ``exp`` or a division (docs/hooks.md#algorithm).
    """

    #: needs ``seq_log_ratio`` (the head must finish a sequence's log-probs first)
    sequence_level: bool

    def value(self, logprobs: torch.Tensor, x: TokenInputs, seq_log_ratio: torch.Tensor | None) -> torch.Tensor:
        """``pg_t`` ``[T]``, differentiable in ``logprobs`` (the plain autograd path)."""
        ...

    def grad(self, logprobs: torch.Tensor, x: TokenInputs,
             seq_log_ratio: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pg_t, ∂pg_t/∂logp_t)`` in closed form, elementwise, without autograd."""
        ...

    def metrics(self, logprobs: torch.Tensor, x: TokenInputs,
                seq_log_ratio: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Per-token indicator/statistic tensors ``[T]`` (``clipfrac``, ``ratio`` ...) that
        core averages over the step's loss tokens."""
        ...


@dataclass(frozen=True)
class Algorithm:
    """A built algorithm: its advantage estimator and its policy loss."""

    advantages: AdvantageEstimator
    loss: PolicyLoss
    #: uses per-token rewards (REINFORCE++): the KL-in-reward penalty stays per token instead
    #: of being summed into the sample's reward
    token_level_rewards: bool = False
    #: the estimator needs each prompt's greedy response's reward (ReMax): core generates one more
    #: response per prompt (``top_k = 1``) each step and passes it in ``AdvantageInput.baseline_rewards``
    greedy_baseline: bool = False


@dataclass(frozen=True)
class AlgorithmSpec(ProviderSpec):
    """An algorithm provider: ``factory(settings) -> Algorithm``, where ``settings`` is the
    validated ``algorithm:`` config section (core's fields and this algorithm's own).

    :param settings: a dataclass whose fields (with defaults) are this algorithm's own keys
        under ``algorithm:``; unknown keys and wrong types are config errors naming the key.
        Field names must not repeat core's (``name``, ``loss_agg``, ``kl_coef`` ...).
    :param validate: optional ``validate(section)`` for value checks types cannot express;
        raises :class:`rlcore.errors.ConfigError` with ``key="algorithm.<field>"``.
    :param loss_agg: the aggregation the algorithm's publication uses, taken when the config
        says ``loss_agg: auto`` (``None``: ``token-mean``).
    :param source: the paper or reference formula it implements (shown by ``rlcore plugins``).
    :param head_needs: ``forward_fn`` capabilities the algorithm needs: with ``Cap.SUM_PI_SQUARED``
        core asks the head for ``Σπ²`` in the old-log-prob pass and fills
        ``AdvantageInput.sum_pi_squared``; a selected head that lacks one is refused at config time.
    :param single_turn: the estimator is defined for one completion per prompt only (ReMax: its
        baseline is one greedy completion of the prompt), so a multi-turn environment
        (``environment.name`` other than ``single_turn``) is refused at config time naming that key.
    """

    settings: type | None = None
    validate: Callable[[Any], None] | None = None
    loss_agg: str | None = None
    source: str = ""
    head_needs: frozenset[str] = frozenset()
    single_turn: bool = False
    kind: str = field(default="algorithm", init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_agg is not None and self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(
                f"AlgorithmSpec({self.name!r}).loss_agg {self.loss_agg!r} is not one of {', '.join(LOSS_AGGREGATIONS)}"
            )
