"""Every algorithm of rlcore-algorithms passes core's algorithm conformance suite."""

import pytest
from rlcore.algorithms import LOSS_AGGREGATIONS, TokenObjective
from rlcore.testing.algorithm_conformance import (
    AlgorithmConformance,
    closed_form_step,
    random_step,
    step_loss,
)
from rlcore_algorithms.plugin import algorithm

SPECS = {s.name: s for s in algorithm()}
#: Clip-Cov and KL-Cov pick their tokens by a covariance over the tokens one loss call sees (a
#: micro-batch, as verl's per-micro-batch call does): their step loss depends on the split by
#: definition (docs/algorithms.md), so they are checked apart
MICRO_BATCH_LOCAL = ("clip_cov", "kl_cov")


#: ReMax's estimator needs AdvantageInput.baseline_rewards (the trainer's greedy responses)
NEEDS_BASELINES = ("remax",)


@pytest.fixture(params=sorted(set(SPECS) - set(MICRO_BATCH_LOCAL) - set(NEEDS_BASELINES)))
def plugin_spec(request):
    return SPECS[request.param]


class TestPluginAlgorithms(AlgorithmConformance):
    @pytest.fixture
    def spec(self, plugin_spec):
        return plugin_spec


class _MicroBatchLocal(AlgorithmConformance):
    """Every check but split invariance; with the step in one micro-batch the closed form (what
    a fused head uses) equals autograd for every aggregation."""

    @pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
    def test_step_loss_is_exact_under_micro_batch_splits(self, spec, built, mode):
        objective = TokenObjective(built.loss, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
        batch = random_step(5)
        full = step_loss(batch, objective, mode, micro_batch_tokens=10 ** 6)
        closed = closed_form_step(batch, objective, mode)
        assert closed[0] == pytest.approx(full[0], rel=1e-5, abs=1e-6)
        for a, b in zip(closed[1:], full[1:], strict=True):
            assert a.tolist() == pytest.approx(b.tolist(), rel=1e-5, abs=self.atol)


class TestClipCov(_MicroBatchLocal):
    #: the selected tokens are dropped at r = 1 too: the derivative there is −A elsewhere only
    policy_gradient_at_proximal = False
    overrides = ["algorithm.clip_cov_ratio=0.2", "algorithm.clip_cov_lb=0.01"]  # select a few tokens

    @pytest.fixture
    def spec(self):
        return SPECS["clip_cov"]


class TestKLCov(_MicroBatchLocal):
    overrides = ["algorithm.kl_cov_ratio=0.2"]

    @pytest.fixture
    def spec(self):
        return SPECS["kl_cov"]


class TestGSPOWithRLOOAdvantages(AlgorithmConformance):
    overrides = ["algorithm.advantage=rloo", "algorithm.clip_low=0.1", "algorithm.clip_high=0.1"]

    @pytest.fixture
    def spec(self):
        return SPECS["gspo"]


class TestDPPOKLWithTightRegion(AlgorithmConformance):
    """Thresholds small enough that the random step's tokens fall on both sides of the region."""

    overrides = ["algorithm.clip_low=0.001", "algorithm.clip_high=0.001", "algorithm.clip_ratio_c=1.5"]

    @pytest.fixture
    def spec(self):
        return SPECS["dppo_kl"]


class TestGMPOTightClipWithRLOO(AlgorithmConformance):
    overrides = ["algorithm.clip_low=0.05", "algorithm.clip_high=0.05", "algorithm.advantage=rloo"]

    @pytest.fixture
    def spec(self):
        return SPECS["gmpo"]


class TestReMax(AlgorithmConformance):
    """The advantage checks with greedy baselines in the input, as the trainer passes them."""

    @pytest.fixture
    def spec(self):
        return SPECS["remax"]

    @staticmethod
    def _with_baselines(inp):
        import dataclasses

        import torch

        b = torch.linspace(0.0, 2.0, len(inp.token_rewards))
        return dataclasses.replace(inp, baseline_rewards=b)

    def test_advantages_shape_and_finite(self, spec, built):
        from rlcore.testing import algorithm_conformance as ac

        inp = self._with_baselines(ac._advantage_input(1))
        adv = built.advantages(inp)
        assert [tuple(a.shape) for a in adv] == [tuple(t.shape) for t in inp.token_rewards]
        assert all(bool(a.isfinite().all()) for a in adv)

    def test_advantages_follow_the_samples_order(self, spec, built):
        from rlcore.testing import algorithm_conformance as ac

        inp = self._with_baselines(ac._advantage_input(2))
        perm = [3, 0, 8, 1, 5, 2, 7, 4, 6]
        shuffled = type(inp)(inp.rewards[perm], inp.groups[perm], [inp.token_rewards[i] for i in perm],
                             [inp.logprobs[i] for i in perm], baseline_rewards=inp.baseline_rewards[perm])
        a, b = built.advantages(inp), built.advantages(shuffled)
        for j, i in enumerate(perm):
            assert b[j].tolist() == pytest.approx(a[i].tolist())
