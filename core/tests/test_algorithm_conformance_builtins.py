"""Every built-in algorithm passes the algorithm conformance suite."""

import pytest
from rlcore.builtin.algorithms import algorithm
from rlcore.testing.algorithm_conformance import AlgorithmConformance

SPECS = {s.name: s for s in algorithm()}


@pytest.fixture(params=sorted(SPECS))
def builtin_spec(request):
    return SPECS[request.param]


class TestBuiltinAlgorithms(AlgorithmConformance):
    @pytest.fixture
    def spec(self, builtin_spec):
        return builtin_spec


class TestGSPOWithRLOOAdvantages(AlgorithmConformance):
    overrides = ["algorithm.advantage=rloo", "algorithm.clip_low=0.1", "algorithm.clip_high=0.1"]

    @pytest.fixture
    def spec(self):
        return SPECS["gspo"]


class TestGRPOUnbiasedStdNoDualClip(AlgorithmConformance):
    overrides = ["algorithm.std=unbiased", "algorithm.clip_ratio_c=0"]

    @pytest.fixture
    def spec(self):
        return SPECS["grpo"]
