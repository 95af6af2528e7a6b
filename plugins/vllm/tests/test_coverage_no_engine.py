"""Which parameters a push reached, from the names vLLM's ``load_weights`` returned
(rlcore_vllm.worker_ext.ParameterCoverage), for both fused-MoE layouts vLLM has shipped.

vLLM 0.26 (GPU) and 0.32 both keep a fused-MoE layer's experts in a ``routed_experts`` child of the
runner (``...mlp.experts.routed_experts.w13_weight``). vLLM 0.26's ``MoERunner.load_weights`` is
``return self.routed_experts.load_weights(weights)``, which yields ``w13_weight`` / ``w2_weight``;
vLLM's ``AutoWeightsLoader._load_module`` qualifies them with the runner's prefix only, so a push
that loaded the experts came back as ``...mlp.experts.w13_weight`` and was refused ("did not reach 8
of 39 vLLM parameters", docs/benchmarks/gpu_e2e.md). vLLM 0.32's runner yields
``routed_experts.{name}``. The trees below are real modules of that shape; the names are the ones
vLLM's loader returns for each (the same push through vLLM 0.32's real loader, with 0.26's runner
put back, is test_vllm_verification.py::test_moe_push_reported_the_vllm_0_26_way_is_covered_and_exact)."""

from __future__ import annotations

import pytest
import torch
from rlcore_vllm.worker_ext import ParameterCoverage

LAYERS = 2


class _Experts(torch.nn.Module):  # RoutedExperts: owns the experts, loads them
    def __init__(self):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(4, 6, 3))
        self.w2_weight = torch.nn.Parameter(torch.zeros(4, 3, 3))

    def load_weights(self, weights):
        return {name for name, _ in weights}


class _Runner(torch.nn.Module):  # MoERunner: the block's ``experts``, hands loading to its child
    def __init__(self, **children):
        super().__init__()
        for name, child in (children or {"routed_experts": _Experts()}).items():
            self.add_module(name, child)

    def load_weights(self, weights):
        return self.routed_experts.load_weights(weights)


class _Block(torch.nn.Module):
    def __init__(self, runner):
        super().__init__()
        self.gate = torch.nn.Linear(3, 4, bias=False)
        self.experts = runner


class _Model(torch.nn.Module):  # Qwen3MoeForCausalLM's shape: model.layers.{i}.mlp.experts
    def __init__(self, runner=_Runner):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.load_weights = lambda weights: set()  # Qwen3MoeModel loads through AutoWeightsLoader
        self.model.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            layer = torch.nn.Module()
            layer.mlp = _Block(runner())
            self.model.layers.append(layer)
        self.lm_head = torch.nn.Linear(3, 5, bias=False)

    def load_weights(self, weights):
        return set()


def _others(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".experts." not in n}


def _reported_by_vllm_0_26(i: int) -> set[str]:
    return {f"model.layers.{i}.mlp.experts.w13_weight", f"model.layers.{i}.mlp.experts.w2_weight"}


def _reported_by_vllm_0_32(i: int) -> set[str]:
    return {f"model.layers.{i}.mlp.experts.routed_experts.w13_weight",
            f"model.layers.{i}.mlp.experts.routed_experts.w2_weight"}


@pytest.mark.parametrize("reported", [_reported_by_vllm_0_26, _reported_by_vllm_0_32], ids=["vllm-0.26", "vllm-0.32"])
def test_a_push_that_loaded_every_expert_reaches_every_parameter(reported):
    model = _Model()
    coverage = ParameterCoverage(model)
    coverage.record(_others(model))
    for i in range(LAYERS):
        coverage.record(reported(i))
    assert coverage.missing() == []
    assert coverage.reached == coverage.expected  # the model's own names, whatever vLLM returned


def test_experts_not_loaded_stay_missing_under_their_own_names():
    model = _Model()
    coverage = ParameterCoverage(model)
    coverage.record(_others(model) | {"model.layers.0.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"})
    assert coverage.missing() == ["model.layers.0.mlp.experts.routed_experts.w2_weight",
                                  "model.layers.1.mlp.experts.routed_experts.w13_weight"]


def test_a_name_that_could_mean_two_parameters_counts_for_neither():
    class TwoChildren(_Runner):
        def __init__(self):
            super().__init__(routed_experts=_Experts(), other_experts=_Experts())

    model = _Model(TwoChildren)
    coverage = ParameterCoverage(model)
    coverage.record(_others(model) | _reported_by_vllm_0_26(0) | _reported_by_vllm_0_32(1)
                    | {f"model.layers.1.mlp.experts.other_experts.{p}" for p in ("w13_weight", "w2_weight")})
    # layer 1 reported its full names; layer 0's short names are ambiguous: all four stay missing
    assert coverage.missing() == sorted(f"model.layers.0.mlp.experts.{c}.{p}" for c in ("other_experts", "routed_experts")
                                        for p in ("w13_weight", "w2_weight"))


def test_a_parameter_of_the_runner_itself_is_never_taken_for_its_childs():
    class WithOwnW2(_Runner):
        def __init__(self):
            super().__init__()
            self.w2_weight = torch.nn.Parameter(torch.zeros(3))

    model = _Model(WithOwnW2)
    coverage = ParameterCoverage(model)
    coverage.record(_others(model))
    for i in range(LAYERS):
        coverage.record(_reported_by_vllm_0_26(i))
    # "...experts.w2_weight" is the runner's own parameter: its child's w2_weight was not reported
    assert coverage.missing() == [f"model.layers.{i}.mlp.experts.routed_experts.w2_weight" for i in range(LAYERS)]


def test_names_no_parameter_has_reach_nothing():
    model = _Model()
    coverage = ParameterCoverage(model)
    coverage.record(["model.layers.0.mlp.w13_weight", "lm_head.bias", "model.layers.0.mlp.experts.w13_weight"])
    assert coverage.reached == {"model.layers.0.mlp.experts.routed_experts.w13_weight"}
