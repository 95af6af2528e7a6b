"""Every one of core's built-in algorithms passes the algorithm conformance suite (rlcore-algorithms'
run it in plugins/algorithms/tests/test_algorithm_conformance.py)."""

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


class TestGRPOUnbiasedStdNoDualClip(AlgorithmConformance):
    overrides = ["algorithm.std=unbiased", "algorithm.clip_ratio_c=0"]

    @pytest.fixture
    def spec(self):
        return SPECS["grpo"]
