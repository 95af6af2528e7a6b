"""Conformance suite for ``algorithm`` providers. A plugin's tests subclass
:class:`AlgorithmConformance` and supply the spec; pytest runs every check below against it.

.. code-block:: python

    from rlcore.testing.algorithm_conformance import AlgorithmConformance

    class TestMyAlgorithm(AlgorithmConformance):
        @pytest.fixture
        def spec(self):
            return MY_SPEC                      # the AlgorithmSpec your hook yields

        overrides = ["algorithm.clip=0.1"]     # optional: settings to test with

It checks the descriptor and its settings against core's config, that the estimator returns one
finite ``[n_i]`` tensor per sample and is equivariant to the order of samples, that the loss's
closed-form derivative equals autograd through its value (with and without sequence-level
ratios, masked tokens holding garbage), that at the proximal policy the derivative is the
policy gradient ``−A`` (opt out with ``policy_gradient_at_proximal = False``), and that core's
step loss built on it is exact under any micro-batch split for every aggregation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from rlcore.algorithms import objective as objmod
from rlcore.algorithms.aggregation import step_weights
from rlcore.algorithms.losses import TokenObjective
from rlcore.algorithms.spec import LOSS_AGGREGATIONS, AdvantageInput, Algorithm, AlgorithmSpec, PolicyLoss
from rlcore.batch import PackedBatch
from rlcore.testing.contracts import assert_close
from rlcore.types import implements

__all__ = [
    "AlgorithmConformance", "RECOMPUTED", "algorithm_section", "closed_form_step", "random_step", "step_loss",
]

RECOMPUTED = "recomputed_logprobs"


def algorithm_section(spec: AlgorithmSpec, overrides: Sequence[str] = ()) -> Any:
    """The validated ``algorithm:`` config section selecting ``spec`` (core's keys and its own)."""
    from rlcore import config as cfgmod

    raw = cfgmod.read_raw(None, [f"algorithm.name={spec.name}", *overrides])
    return cfgmod.validate(raw, (), algorithms={spec.name: spec}).algorithm


def random_step(seed: int = 0, num_seqs: int = 7, max_prompt: int = 4, max_response: int = 6, vocab: int = 50,
                spread: float = 0.3, groups_of: int = 3) -> PackedBatch:
    """A packed step of random sequences whose fields a trainer would have filled before the
    train pass: rollout and recomputed log-probs (``spread`` apart from the current policy's,
    which is returned in the field ``logprobs`` with ``entropy``), advantages, reference
    log-probs, mismatch weights, a seq field ``group``."""
    g = torch.Generator().manual_seed(seed)
    seqs, starts, tf = [], [], {k: [] for k in ("old_logprobs", RECOMPUTED, "advantages", "ref_logprobs",
                                               "logprobs", "entropy", objmod.CORRECTION)}
    for _ in range(num_seqs):
        p = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        r = int(torch.randint(1, max_response + 1, (1,), generator=g))
        seqs.append(torch.randint(0, vocab, (p + r,), generator=g))
        starts.append(p)
        cur = -torch.rand(r, generator=g) * 3 - 0.05
        tf["logprobs"].append(cur)
        tf[RECOMPUTED].append(cur + spread * torch.randn(r, generator=g))
        tf["old_logprobs"].append(cur + spread * torch.randn(r, generator=g))
        tf["ref_logprobs"].append(cur + spread * torch.randn(r, generator=g))
        tf["advantages"].append(torch.full((r,), float(torch.randn(1, generator=g))) + 0.1 * torch.randn(r, generator=g))
        tf["entropy"].append(torch.rand(r, generator=g) * 2)
        tf[objmod.CORRECTION].append(torch.rand(r, generator=g) * 2)
    batch = PackedBatch.pack(seqs, starts, target_fields=tf,
                             seq_fields={"group": torch.arange(num_seqs) // groups_of})
    # masked positions hold garbage, as in a real batch after the head ran
    garbage = torch.randn(batch.num_tokens, generator=g) * 5
    for k in tf:
        batch.fields[k] = torch.where(batch.loss_mask, batch.fields[k], garbage)
    batch.fields[objmod.AGG_NUMERATOR] = batch.loss_mask.to(torch.float32)
    return batch


def step_loss(batch: PackedBatch, objective: TokenObjective, mode: str, micro_batch_tokens: int,
              proximal: str = RECOMPUTED, norm_tokens: int = 8) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Core's step loss over micro-batches of ``micro_batch_tokens`` (plain autograd path):
    the loss and its gradients w.r.t. the current log-probs and entropy ``[T]``."""
    w = step_weights(mode, batch.loss_mask, batch.seq_index(), batch.num_seqs, norm_tokens)
    batch.fields[objmod.AGG_NUMERATOR] = w.numerator
    logp = batch.fields["logprobs"].clone().requires_grad_(True)
    ent = batch.fields["entropy"].clone().requires_grad_(True)
    total = 0.0
    for mb in batch.micro_batches(micro_batch_tokens):
        t0 = mb.token_offset - batch.token_offset
        sl = slice(t0, t0 + mb.num_tokens)
        loss, _ = objmod.micro_batch_loss(mb, logp[sl], ent[sl], objective, w.divisor, proximal)
        loss.backward()
        total += float(loss.detach())
    return total, logp.grad.clone(), ent.grad.clone()


def closed_form_step(batch: PackedBatch, objective: TokenObjective, mode: str, proximal: str = RECOMPUTED,
                     norm_tokens: int = 8):
    """The same step loss from :meth:`TokenObjective.closed_form` (no autograd)."""
    w = step_weights(mode, batch.loss_mask, batch.seq_index(), batch.num_seqs, norm_tokens)
    batch.fields[objmod.AGG_NUMERATOR] = w.numerator
    tl = objmod.closed_form(batch, batch.fields["logprobs"], batch.fields["entropy"], objective, w.divisor, proximal)
    return float(tl.value.sum()), tl.d_logprobs, tl.d_entropy


def _advantage_input(seed: int, num_samples: int = 9, group: int = 3) -> AdvantageInput:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 6, (num_samples,), generator=g).tolist()
    rewards = torch.randint(0, 3, (num_samples,), generator=g).float()
    token_rewards = []
    for n, r in zip(lens, rewards.tolist(), strict=False):
        tr = -0.01 * torch.rand(n, generator=g)
        tr[-1] += r
        token_rewards.append(tr)
    logprobs = [-torch.rand(n, generator=g) for n in lens]
    # Σπ² between π² (all mass on the sampled token's rivals in one) and π² + (1−π)²
    sum_sq = [lp.exp() ** 2 + (1 - lp.exp()) ** 2 * torch.rand(lp.shape[0], generator=g) for lp in logprobs]
    return AdvantageInput(
        rewards=torch.tensor([float(t.sum()) for t in token_rewards]),
        groups=torch.arange(num_samples) // group,
        token_rewards=token_rewards,
        logprobs=logprobs,
        recomputed_logprobs=logprobs,
        sum_pi_squared=sum_sq,
    )


class AlgorithmConformance:
    """Checks for an algorithm provider. Subclass and provide a ``spec`` fixture."""

    #: ``algorithm.*`` dotlist overrides to build the algorithm with
    overrides: Sequence[str] = ()
    #: at the proximal policy (logp == old) the derivative is −A (every PG loss we know)
    policy_gradient_at_proximal: bool = True
    atol: float = 1e-5

    @pytest.fixture
    def spec(self) -> AlgorithmSpec:  # pragma: no cover - must be overridden
        raise NotImplementedError("provide a `spec` fixture returning your AlgorithmSpec")

    @pytest.fixture
    def built(self, spec) -> Algorithm:
        return spec.factory(algorithm_section(spec, self.overrides))

    def test_descriptor_and_settings(self, spec):
        assert isinstance(spec, AlgorithmSpec), f"the algorithm hook must yield AlgorithmSpec, got {type(spec).__name__}"
        who = _who(spec)
        if spec.settings is not None:
            assert dataclasses.is_dataclass(spec.settings), f"{who}: AlgorithmSpec.settings must be a dataclass"
            spec.settings()  # every field has a default
        assert spec.loss_agg is None or spec.loss_agg in LOSS_AGGREGATIONS, (
            f"{who}: loss_agg {spec.loss_agg!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")
        section = algorithm_section(spec, self.overrides)
        assert section.name == spec.name, f"{who}: algorithm.name={spec.name} resolves to {section.name!r}"
        assert section.loss_agg == (spec.loss_agg or "token-mean"), (
            f"{who}: loss_agg auto must resolve to the spec's {spec.loss_agg or 'token-mean'!r}, got {section.loss_agg!r}")

    def test_unknown_setting_is_a_config_error_naming_it(self, spec):
        from rlcore.errors import ConfigError

        with pytest.raises(ConfigError, match="algorithm.no_such_setting_xyz"):
            algorithm_section(spec, [*self.overrides, "algorithm.no_such_setting_xyz=1"])

    def test_factory_builds_an_algorithm(self, spec, built):
        who = _who(spec)
        assert isinstance(built, Algorithm), f"{who}: factory(section) must return an Algorithm, got {type(built).__name__}"
        assert callable(built.advantages), f"{who}: Algorithm.advantages must be callable (an AdvantageEstimator)"
        assert implements(built.loss, PolicyLoss), (
            f"{who}: Algorithm.loss must be a PolicyLoss (value, grad, metrics, sequence_level)")
        assert isinstance(built.loss.sequence_level, bool), f"{who}: PolicyLoss.sequence_level must be a bool"

    def test_advantages_shape_and_finite(self, spec, built):
        who = _who(spec)
        inp = _advantage_input(1)
        adv = built.advantages(inp)
        assert len(adv) == len(inp.token_rewards), (
            f"{who} advantages: one tensor per sample expected ({len(inp.token_rewards)}), got {len(adv)}")
        for i, (a, tr) in enumerate(zip(adv, inp.token_rewards, strict=False)):
            assert tuple(a.shape) == tuple(tr.shape), (
                f"{who} advantages: sample {i} has {tr.shape[0]} response tokens, its advantages have shape {tuple(a.shape)}")
            assert bool(torch.isfinite(a).all()), f"{who} advantages: sample {i} has non-finite advantages {a.tolist()}"

    def test_advantages_follow_the_samples_order(self, spec, built):
        inp = _advantage_input(2)
        perm = torch.randperm(len(inp.token_rewards), generator=torch.Generator().manual_seed(0)).tolist()
        shuffled = AdvantageInput(inp.rewards[perm], inp.groups[perm], [inp.token_rewards[i] for i in perm],
                                  [inp.logprobs[i] for i in perm],
                                  recomputed_logprobs=[inp.recomputed_logprobs[i] for i in perm],
                                  sum_pi_squared=[inp.sum_pi_squared[i] for i in perm])
        a, b = built.advantages(inp), built.advantages(shuffled)
        for j, i in enumerate(perm):
            assert_close(b[j], a[i], f"{_who(spec)} advantages: a sample's advantages must not depend on the order "
                         f"of the samples (sample {i}, moved to position {j})", atol=1e-6, rtol=1e-5)

    def test_closed_form_derivative_matches_autograd(self, spec, built):
        batch = random_step(3)
        x = objmod.token_inputs(batch, RECOMPUTED, 1.0, with_ref=False)
        logp = batch.fields["logprobs"].clone().requires_grad_(True)
        slr = objmod.seq_log_ratio(batch, logp, x) if built.loss.sequence_level else None
        built.loss.value(logp, x, slr).mul(x.mask).sum().backward()
        value, grad = built.loss.grad(batch.fields["logprobs"], x, slr)
        who = f"{_who(spec)} loss"
        assert_close(grad * x.mask, logp.grad, f"{who}: the derivative grad() returns (∂pg/∂logp, closed form) must "
                     f"equal autograd through value() on the tokens that carry loss", atol=self.atol, rtol=1e-5)
        with torch.no_grad():
            assert_close(value * x.mask, built.loss.value(batch.fields["logprobs"], x, slr) * x.mask,
                         f"{who}: the value grad() returns must equal value() on the tokens that carry loss")

    def test_policy_gradient_at_the_proximal_policy(self, spec, built):
        if not self.policy_gradient_at_proximal:
            pytest.skip("the provider opts out")
        batch = random_step(4)
        batch.fields[RECOMPUTED] = batch.fields["logprobs"].clone()
        x = objmod.token_inputs(batch, RECOMPUTED, 1.0, with_ref=False)
        slr = objmod.seq_log_ratio(batch, batch.fields["logprobs"], x) if built.loss.sequence_level else None
        _, grad = built.loss.grad(batch.fields["logprobs"], x, slr)
        assert_close(grad * x.mask, -x.advantages * x.mask, f"{_who(spec)} loss: at the proximal policy (logp == old) "
                     f"the derivative must be the policy gradient −A (set policy_gradient_at_proximal = False "
                     f"if the loss is not a policy gradient there)", atol=self.atol, rtol=1e-5)

    @pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
    def test_step_loss_is_exact_under_micro_batch_splits(self, spec, built, mode):
        who = f"{_who(spec)} step loss (loss_agg {mode})"
        objective = TokenObjective(built.loss, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
        batch = random_step(5)
        full = step_loss(batch, objective, mode, micro_batch_tokens=10 ** 6)
        for budget in (4, 17):
            split = step_loss(batch, objective, mode, micro_batch_tokens=budget)
            where = f"{who}, micro-batches of {budget} tokens vs one"
            assert abs(split[0] - full[0]) <= 1e-5 * max(1.0, abs(full[0])), (
                f"{where}: the summed micro-batch losses {split[0]!r} must equal the whole step's {full[0]!r}")
            assert_close(split[1], full[1], f"{where}: ∂loss/∂logp must not depend on the split",
                         atol=self.atol, rtol=1e-5)
            assert_close(split[2], full[2], f"{where}: ∂loss/∂entropy must not depend on the split",
                         atol=self.atol, rtol=1e-5)
        closed = closed_form_step(batch, objective, mode)
        where = f"{who}, TokenObjective.closed_form (what a fused head uses) vs autograd"
        assert abs(closed[0] - full[0]) <= 1e-5 * max(1.0, abs(full[0])), (
            f"{where}: the closed-form loss {closed[0]!r} must equal autograd's {full[0]!r}")
        assert_close(closed[1], full[1], f"{where}: ∂loss/∂logp", atol=self.atol, rtol=1e-5)
        assert_close(closed[2], full[2], f"{where}: ∂loss/∂entropy", atol=self.atol, rtol=1e-5)


def _who(spec: AlgorithmSpec) -> str:
    return f"algorithm {spec.name!r}"
