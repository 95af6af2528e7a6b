"""What a third-party algorithm author meets, tried as an outsider would (issue 24, item 6): a tiny
plugin ``opo`` (its own advantage estimator, core's PPO-clip loss) written against the public
contracts only, tested with rlcore's fixtures and conformance suite, installed but not activated,
and trained through the real trainer."""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from rlcore import PLUGIN_API, hookimpl

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class OPOSettings:
    """``algorithm.baseline_scale``: how much of the group's mean reward is subtracted."""

    baseline_scale: float = 1.0


@dataclass(frozen=True)
class ScaledBaselineAdvantage:
    """``A_i = r_i − s·mean(r_group)`` on every response token of sample ``i``."""

    scale: float = 1.0
    calls: list = None  # type: ignore[assignment]

    def __call__(self, inp):
        if self.calls is not None:
            self.calls.append(len(inp.token_rewards))
        r = inp.rewards.float()
        base = torch.zeros_like(r)
        for g in torch.unique(inp.groups):
            sel = inp.groups == g
            base[sel] = r[sel].mean()
        adv = r - self.scale * base
        return [torch.full((n,), float(a)) for a, n in zip(adv.tolist(), inp.response_lengths, strict=True)]


def opo_plugin(calls: list | None = None) -> types.ModuleType:
    """The plugin module, as its author writes it: the estimator is its own, the loss is core's."""
    from rlcore.algorithms import Algorithm, AlgorithmSpec

    def build(section):
        from rlcore.algorithms import PPOClip

        return Algorithm(advantages=ScaledBaselineAdvantage(float(section.baseline_scale), calls),
                         loss=PPOClip(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0))

    mod = types.ModuleType("rlcore_opo")
    mod.PLUGIN_API = PLUGIN_API
    mod.algorithm = hookimpl(lambda: [AlgorithmSpec(name="outsider_opo", factory=build, settings=OPOSettings,
                                                    loss_agg="token-mean", source="a test")])
    return mod


def test_rlcore_config_fixture_sees_a_registered_plugins_algorithm(register_plugin, rlcore_config):
    register_plugin(opo_plugin(), "opo")
    cfg = rlcore_config("algorithm.name=outsider_opo", "algorithm.baseline_scale=0.5")
    assert cfg.algorithm.name == "outsider_opo" and cfg.algorithm.baseline_scale == 0.5
    assert cfg.algorithm.loss_agg == "token-mean"  # the spec's own aggregation resolved `auto`
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.baseline_scale"):
        rlcore_config("algorithm.name=outsider_opo", "algorithm.baseline_scale=abc")


def test_the_algorithm_contract_is_importable_from_rlcore_types():
    import rlcore.algorithms as algorithms
    import rlcore.types as contracts

    for name in ("AlgorithmSpec", "Algorithm", "AdvantageInput", "AdvantageEstimator", "TokenInputs",
                 "PolicyLoss", "TokenLoss", "LOSS_AGGREGATIONS"):
        assert getattr(contracts, name) is getattr(algorithms, name), name
        assert name in contracts.__all__


def test_builtin_policy_losses_are_public_and_are_what_the_builtins_use(rlcore_plugin_manager):
    from rlcore.algorithms import PolicyLoss, PPOClip

    algos = rlcore_plugin_manager.algorithms()
    for name, cls in (("grpo", PPOClip), ("rloo", PPOClip), ("dr_grpo", PPOClip), ("ppo", PPOClip)):
        built = algos[name].factory(_section(rlcore_plugin_manager, name))
        assert type(built.loss) is cls and isinstance(built.loss, PolicyLoss)


def _section(pm, name):
    from rlcore.stack import load_config

    return load_config(None, [f"algorithm.name={name}"], plugins=pm)[0].algorithm


def test_listing_a_plugin_that_imports_the_public_algorithm_api_imports_no_torch():
    from rlcore.testing.imports import modules_loaded_by

    assert modules_loaded_by("import rlcore.algorithms, rlcore.types; rlcore.algorithms.AlgorithmSpec",
                             ["torch"]) == []


# ------------------------------------------------------------------- conformance messages ----

class _HalfWrongLoss:
    """A loss whose closed-form derivative is twice the true one."""

    sequence_level = False

    def value(self, logprobs, x, seq_log_ratio=None):
        return torch.where(x.mask, -x.advantages * logprobs, torch.zeros_like(logprobs))

    def grad(self, logprobs, x, seq_log_ratio=None):
        return self.value(logprobs, x), torch.where(x.mask, -2 * x.advantages, torch.zeros_like(logprobs))

    def metrics(self, logprobs, x, seq_log_ratio=None):
        return {}


def test_a_broken_algorithm_fails_conformance_naming_the_contract():
    from rlcore.algorithms import Algorithm, AlgorithmSpec
    from rlcore.algorithms.advantages import DrGRPOAdvantage
    from rlcore.testing.algorithm_conformance import AlgorithmConformance

    spec = AlgorithmSpec(name="wrong-grad", factory=lambda s: Algorithm(DrGRPOAdvantage(), _HalfWrongLoss()))
    suite = AlgorithmConformance()
    built = spec.factory(None)
    with pytest.raises(AssertionError) as err:
        suite.test_closed_form_derivative_matches_autograd(spec, built)
    text = str(err.value)
    assert "algorithm 'wrong-grad'" in text and "grad()" in text and "autograd" in text
    assert "Mismatched elements" in text  # torch's numbers are kept
    with pytest.raises(AssertionError) as err:
        suite.test_policy_gradient_at_the_proximal_policy(spec, built)
    assert "algorithm 'wrong-grad'" in str(err.value) and "−A" in str(err.value)


def test_a_broken_head_fails_conformance_naming_the_contract():
    from rlcore.testing.conformance import ForwardFnConformance
    from rlcore.types import Cap, HeadOutput

    def ignores_temperature(inp):
        logits = inp.hidden.float() @ inp.weight[: inp.vocab.vocab_size].float().T
        lp = torch.log_softmax(logits, -1)
        safe = torch.where(inp.loss_mask, inp.labels, torch.zeros_like(inp.labels))
        out = lp.gather(1, safe[:, None]).squeeze(1) * inp.loss_mask
        ent = -(lp.exp() * lp).sum(-1) * inp.loss_mask
        return HeadOutput(logprobs=out, entropy=ent)

    suite = ForwardFnConformance()
    suite.capabilities = frozenset({Cap.ENTROPY})
    suite.test_forward_matches_float64(ignores_temperature)  # right at temperature 1
    with pytest.raises(AssertionError) as err:
        suite.test_scalar_temperature(ignores_temperature)
    text = str(err.value)
    assert "forward_fn" in text and "temperature" in text and "Mismatched elements" in text


# ------------------------------------------------------------- installed but not active -----

OPO_PLUGIN_SOURCE = """
from dataclasses import dataclass
from rlcore import PLUGIN_API, hookimpl
from rlcore.algorithms import AlgorithmSpec
from rlcore.types import ForwardFnSpec

@hookimpl
def algorithm():
    yield AlgorithmSpec(name="outsider_opo", factory=lambda section: None, source="a test")

@hookimpl
def forward_fn():
    yield ForwardFnSpec(name="opo-head", factory=lambda ctx: None)
"""


def test_an_installed_but_inactive_algorithm_plugin_is_named(fake_distribution, monkeypatch):
    from rlcore.errors import ConfigError
    from rlcore.stack import load_config, resolve

    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    fake_distribution("rlcore-opo", "0.3", entry_points={"opo-plugin": "rlcore_opo_plugin"},
                      modules={"rlcore_opo_plugin": OPO_PLUGIN_SOURCE})
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=outsider_opo"])
    text = str(err.value)
    assert err.value.key == "algorithm.name"
    assert "'opo-plugin'" in text and "rlcore-opo 0.3" in text and "installed but not active" in text
    assert "plugins:" in text
    cfg, _ = load_config(None, ["algorithm.name=outsider_opo", "plugins=[opo-plugin]"])  # the hint's fix works
    assert cfg.algorithm.name == "outsider_opo"
    # the same for a third-party plugin's other providers, as for first-party ones
    cfg, pm = load_config(None, ["forward.name=opo-head"])
    with pytest.raises(ConfigError, match="'opo-plugin' .*installed but not active") as err:
        resolve(cfg, pm)
    assert err.value.key == "forward.name"


def test_an_unknown_algorithm_still_lists_the_choices(monkeypatch):
    from rlcore.errors import ConfigError
    from rlcore.stack import load_config

    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    with pytest.raises(ConfigError, match="not a known algorithm. Choose one of: .*grpo"):
        load_config(None, ["algorithm.name=no-such-algo"])


# ------------------------------------------------------------------------ real training -----

@pytest.mark.slow
def test_a_third_party_estimator_with_the_builtin_ppo_clip_loss_trains(tmp_path, rlcore_plugin_manager,
                                                                      register_plugin):
    from rlcore.run_output import read_metrics
    from rlcore.stack import load_config, resolve
    from rlcore.trainer import Trainer

    calls: list[int] = []
    register_plugin(opo_plugin(calls), "opo")
    cfg, pm = load_config(ROOT / "examples" / "tiny.yaml",
                          ["training.steps=2", "rollout.n=4", "data.prompts_per_step=4", "algorithm.name=outsider_opo",
                           "algorithm.baseline_scale=1.0", f"output.dir={tmp_path}", "output.plot=false",
                           "output.tensorboard=false", "output.progress=false", "output.checkpoint_every=0"],
                          plugins=rlcore_plugin_manager)
    stack = resolve(cfg, pm)
    assert stack.algorithm.plugin == "opo"
    Trainer(stack).run()
    rows = read_metrics(tmp_path)
    assert calls == [16, 16]  # the plugin's estimator ran once per step over every sample
    assert len(rows) == 2
    for row in rows:
        assert row["loss"] is not None and row["grad_norm"] > 0
        assert "clipfrac" in row and "dual_clipfrac" in row  # PPO-clip's own metrics, from core's loss


def test_tensorboard_note_names_the_extra(tmp_path, monkeypatch):
    import sys

    from rlcore.stack import load_stack

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as without the tensorboard package
    stack = load_stack(str(ROOT / "examples" / "tiny.yaml"))  # output.tensorboard: the default, true
    (note,) = [n for n in stack.notes if "tensorboard" in n.lower()]
    assert "rlcore[tensorboard]" in note and "output.tensorboard=false" in note
    assert "tensorboard" not in [t.name for t in stack.trackers]
