"""The example plugin's own tests, as an outsider writes them: rlcore's pytest fixtures and
conformance suite, nothing from rlcore's internals."""

import pytest
import torch

import rlcore_example.plugin as plugin
from rlcore.batch import PackedBatch
from rlcore.testing.conformance import ForwardFnConformance
from rlcore.types import MicroBatchContext, StepContext
from rlcore_example.head import NaiveHead

SPEC = next(iter(plugin.forward_fn()))


class TestNaiveHead(ForwardFnConformance):
    capabilities = SPEC.capabilities

    @pytest.fixture
    def forward_fn(self):
        return NaiveHead()


def test_plugin_is_found_through_its_entry_point():
    from rlcore.manager import PluginManager

    pm = PluginManager()
    pm.activate(["example"])
    spec = pm.select("forward_fn", "example-naive", key="forward.name")
    assert spec.distribution.startswith("rlcore-example-plugin ")
    assert pm.implementers("postprocess") == ["example"]


def test_the_outsiders_engine_and_backend_declare_what_a_launcher_needs():
    from rlcore.manager import PluginManager
    from rlcore.types import Cap

    pm = PluginManager()
    pm.activate(["example"])
    engine = pm.select("engine", "outsider-hf", key="engine.name")
    backend = pm.select("rollout_backend", "outsider-local", key="rollout.backend")
    assert engine.distribution.startswith("rlcore-example-plugin ") and Cap.DATA_PARALLEL in engine.capabilities
    assert backend.distribution.startswith("rlcore-example-plugin ") and Cap.REPLICA in backend.capabilities
    assert Cap.TENSOR_PARALLEL not in engine.capabilities


def test_postprocess_adds_length_penalty_only_in_train(rlcore_plugin_manager, register_plugin, rlcore_config):
    register_plugin(plugin, "example")
    cfg = rlcore_config("example.length_penalty=0.5")
    batch = PackedBatch.pack([[1, 2, 3, 4], [5, 6, 7]], [2, 1])

    class Out:
        class head:
            logprobs = torch.log(torch.full((7,), 0.5))

    for phase, expect_loss in (("old_logprob", False), ("train", True)):
        ctx = MicroBatchContext(step=0, phase=phase, index=0, count=1, batch=batch, config=cfg, num_tokens_in_step=4)
        ((name, res),) = rlcore_plugin_manager.postprocess(ctx, Out)
        assert name == "example"
        assert res.metrics["example/response_tokens"] == 2.0  # 4 loss tokens over 2 sequences
        assert ("length_penalty" in res.loss_terms) is expect_loss
        if expect_loss:
            assert float(res.loss_terms["length_penalty"]) == pytest.approx(0.5 * 0.5 * 4 / 4)


def test_step_end_reports_and_resets_head_calls():
    head = plugin._build_head(None)
    plugin.CALLS["forward"] = 0
    batch = PackedBatch.pack([[1, 2, 3]], [1])
    from rlcore.types import HeadInput, VocabShard

    head(HeadInput(hidden=torch.randn(3, 4), weight=torch.randn(6, 4), labels=torch.tensor([1, 2, 0]),
                   vocab=VocabShard.full(6), loss_mask=batch.loss_mask))
    assert plugin.step_end(StepContext(0, batch, {})) == {"example/forward_calls": 1.0}
    assert plugin.step_end(StepContext(1, batch, {})) == {"example/forward_calls": 0.0}


# ---------------------------------------------------------------------------- algorithm -----

from rlcore.testing.algorithm_conformance import AlgorithmConformance  # noqa: E402

ALGORITHM = next(iter(plugin.algorithm()))


class TestExampleReinforce(AlgorithmConformance):
    @pytest.fixture
    def spec(self):
        return ALGORITHM


class TestExampleReinforceWithoutBaseline(AlgorithmConformance):
    overrides = ["algorithm.baseline=none"]

    @pytest.fixture
    def spec(self):
        return ALGORITHM


def test_algorithm_is_selected_by_config_with_its_settings(rlcore_plugin_manager, register_plugin):
    from rlcore.errors import ConfigError
    from rlcore.stack import load_config

    register_plugin(plugin, "example")
    cfg, _ = load_config(None, ["algorithm.name=example-reinforce", "algorithm.baseline=none"],
                         plugins=rlcore_plugin_manager)
    assert cfg.algorithm.baseline == "none" and cfg.algorithm.loss_agg == "token-mean"
    with pytest.raises(ConfigError, match="algorithm.baseline"):
        load_config(None, ["algorithm.name=example-reinforce", "algorithm.baseline=median"], plugins=rlcore_plugin_manager)
    built = rlcore_plugin_manager.algorithms()["example-reinforce"].factory(cfg.algorithm)
    from rlcore.algorithms import AdvantageInput

    inp = AdvantageInput(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), [torch.zeros(2), torch.zeros(1)],
                         [torch.zeros(2), torch.zeros(1)])
    assert [a.tolist() for a in built.advantages(inp)] == [[1.0, 1.0], [0.0]]
