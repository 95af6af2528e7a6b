"""Core's built-in estimators, losses, KL terms, aggregations and mismatch correction against small
hand-computed cases; config errors; the hook; an algorithm of rlcore-algorithms selected without
that plugin (the plugin's own: plugins/algorithms/tests)."""

import math
import types

import pytest
import torch
from rlcore import hookimpl
from rlcore.algorithms import advantages as adv
from rlcore.algorithms import objective as objmod
from rlcore.algorithms.aggregation import step_weights
from rlcore.algorithms.losses import PPOClip, TokenObjective, kl_value_and_grad
from rlcore.algorithms.mismatch import MismatchCorrection, mismatch
from rlcore.algorithms.spec import AdvantageInput, Algorithm, AlgorithmSpec, TokenInputs
from rlcore.errors import ConfigError, UnknownProviderError
from rlcore.stack import load_config
from rlcore.testing.algorithm_conformance import RECOMPUTED, random_step


def _inp(rewards, groups, lens=None, token_rewards=None):
    lens = lens or [2] * len(rewards)
    if token_rewards is None:
        token_rewards = []
        for r, n in zip(rewards, lens, strict=False):
            t = torch.zeros(n)
            t[-1] = r
            token_rewards.append(t)
    return AdvantageInput(torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups), token_rewards,
                          [torch.zeros(n) for n in lens])


def _first(xs):
    return [float(x[0]) for x in xs]


# ------------------------------------------------------------------------------ advantages --

def test_grpo_population_and_unbiased_std():
    inp = _inp([1.0, 0.0, 0.0, 1.0, 5.0], [0, 0, 0, 0, 1])
    pop = adv.GRPOAdvantage("population")(inp)
    # mean 0.5, population std 0.5; the single-sample group gets 0
    assert _first(pop) == pytest.approx([0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001, 0.0])
    unb = adv.GRPOAdvantage("unbiased")(inp)
    s = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    assert _first(unb)[:2] == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6)])
    assert all(torch.equal(a, torch.full_like(a, a[0])) for a in pop)  # one advantage per sample


def test_dr_grpo_only_centres():
    assert _first(adv.DrGRPOAdvantage()(_inp([3.0, 1.0, 2.0], [0, 0, 0]))) == pytest.approx([1.0, -1.0, 0.0])


def test_rloo_leave_one_out_baseline():
    assert _first(adv.RLOOAdvantage()(_inp([1.0, 0.0, 0.0, 7.0], [0, 0, 0, 1]))) == pytest.approx([1.0, -0.5, -0.5, 0.0])


# ------------------------------------------------------------------------------- losses -----

def _tokens(logp, old, advantages, seq=None):
    n = len(logp)
    seq_index = torch.tensor(seq if seq is not None else [0] * n)
    mask = torch.ones(n, dtype=torch.bool)
    x = TokenInputs(old_logprobs=torch.tensor(old), rollout_logprobs=torch.tensor(old), advantages=torch.tensor(advantages),
                    mask=mask, weights=torch.ones(n), correction=None, ref_logprobs=None, seq_index=seq_index,
                    seq_tokens=torch.zeros(int(seq_index.max()) + 1).index_add_(0, seq_index, torch.ones(n)))
    return torch.tensor(logp), x


def test_ppo_clip_cases():
    r = [1.5, 1.1, 0.5, 4.0, 2.0]
    a = [1.0, 1.0, -1.0, -1.0, -1.0]
    logp, x = _tokens([math.log(v) for v in r], [0.0] * 5, a)
    pg, g = PPOClip(0.2, 0.28, 3.0).grad(logp, x)
    # clipped at 1.28 | unclipped | clipped at 0.8 | dual-clipped at c=3 | unclipped (2 < c)
    assert pg.tolist() == pytest.approx([-1.28, -1.1, 0.8, 3.0, 2.0], rel=1e-6)
    assert g.tolist() == pytest.approx([0.0, -1.1, 0.0, 0.0, 2.0], rel=1e-6)
    pg_nodual, _ = PPOClip(0.2, 0.28, 0.0).grad(logp, x)
    assert float(pg_nodual[3]) == pytest.approx(4.0)


@pytest.mark.parametrize("est,value", [("k1", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) + 0.5 - 1)])
def test_kl_estimators_value_and_closed_form_derivative(est, value):
    logp = torch.tensor([-1.0, -2.0, -0.3], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.3])
    v, d = kl_value_and_grad(logp.detach(), ref, est)
    assert float(v[0]) == pytest.approx(value)
    kl_value_and_grad(logp, ref, est)[0].sum().backward()
    torch.testing.assert_close(d, logp.grad)


def test_token_objective_closed_form_with_kl_entropy_correction():
    batch = random_step(11)
    obj = TokenObjective(PPOClip(0.2, 0.28, 3.0), kl_coef=0.3, kl_estimator="k2", entropy_coef=0.05)
    lp = batch.fields["logprobs"].clone().requires_grad_(True)
    ent = batch.fields["entropy"].clone().requires_grad_(True)
    loss, _ = objmod.micro_batch_loss(batch, lp, ent, obj, 3.0, RECOMPUTED)
    loss.backward()
    tl = objmod.closed_form(batch, batch.fields["logprobs"], batch.fields["entropy"], obj, 3.0, RECOMPUTED)
    assert float(tl.value.sum()) == pytest.approx(float(loss.detach()), rel=1e-5)
    torch.testing.assert_close(tl.d_logprobs, lp.grad)
    torch.testing.assert_close(tl.d_entropy, ent.grad)
    assert bool((tl.d_logprobs[~batch.loss_mask] == 0).all())


# --------------------------------------------------------------------------- aggregation -----

def test_aggregation_weights_hand_computed():
    mask = torch.tensor([False, True, True, False, True, True, True])
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    want = {
        "token-mean": [1 / 5] * 2 + [1 / 5] * 3,
        "token-sum": [1.0] * 5,
        "seq-mean-token-sum": [1 / 2] * 5,
        "seq-mean-token-mean": [1 / 4] * 2 + [1 / 6] * 3,
        "seq-mean-token-sum-norm": [1 / 8] * 5,
    }
    for mode, w in want.items():
        sw = step_weights(mode, mask, seq, 2, norm_tokens=4)
        assert sw.weights[mask].tolist() == pytest.approx(w), mode
        assert bool((sw.weights[~mask] == 0).all())


# ----------------------------------------------------------------------------- mismatch -----

def test_mismatch_token_tis_mask_and_metrics():
    trainer = torch.tensor([-1.0, -1.0, 0.0])
    rollout = torch.tensor([-1.5, -0.5, 3.0])
    mask = torch.tensor([True, True, False])
    seq = torch.tensor([0, 0, 0])
    r = mismatch(trainer, rollout, mask, seq, 1, MismatchCorrection("token", tis_cap=1.5))
    assert r.correction.tolist() == pytest.approx([1.5, math.exp(-0.5), 0.0])
    m = r.metrics
    assert m["mismatch/truncated_frac"] == 0.5 and m["mismatch/masked_frac"] == 0.0
    assert m["mismatch/kl_k1"] == pytest.approx(0.0)
    assert m["mismatch/kl_k3"] == pytest.approx(((math.exp(0.5) - 1.5) + (math.exp(-0.5) - 0.5)) / 2)
    assert m["mismatch/ratio_max"] == pytest.approx(math.exp(0.5))
    masked = mismatch(trainer, rollout, mask, seq, 1, MismatchCorrection("token", mask_high=1.5))
    assert masked.correction.tolist() == [0.0, 1.0, 0.0]
    assert masked.metrics["mismatch/masked_frac"] == 0.5 and masked.metrics["mismatch/masked_seq_frac"] == 1.0
    # sequence level: the product of the ratios is exp(0.5 - 0.5) = 1
    seqr = mismatch(trainer, rollout, mask, seq, 1, MismatchCorrection("sequence", tis_cap=1.2, mask_high=2.0))
    assert seqr.correction.tolist() == pytest.approx([1.0, 1.0, 0.0])
    off = mismatch(trainer, rollout, mask, seq, 1, MismatchCorrection())
    assert off.correction is None and "mismatch/kl_k3" in off.metrics


def test_mismatch_geometric_level_masks_whole_sequences():
    trainer = torch.tensor([0.0, 0.0, 0.0, 0.0])
    rollout = torch.tensor([-1.0, -1.0, 0.0, -0.1])
    seq = torch.tensor([0, 0, 1, 1])
    r = mismatch(trainer, rollout, torch.ones(4, dtype=torch.bool), seq, 2,
                 MismatchCorrection("geometric", tis_cap=2.0, mask_high=2.5))
    # sequence 0: geometric mean ratio e^1 = 2.718 > 2.5, masked; sequence 1: e^0.05
    assert r.correction.tolist() == pytest.approx([0.0, 0.0, math.exp(0.05), math.exp(0.05)], rel=1e-6)
    assert r.metrics["mismatch/masked_seq_frac"] == 0.5


# ------------------------------------------------------------------------------- config -----

def test_algorithm_config_selects_and_validates(tmp_path):
    cfg, _ = load_config(None, ["algorithm.name=rloo"])
    assert cfg.algorithm.loss_agg == "token-mean" and cfg.algorithm.clip_high == pytest.approx(0.28)
    cfg, _ = load_config(None, ["algorithm.name=dr_grpo", "rollout.max_new_tokens=7"])
    assert cfg.algorithm.loss_agg == "seq-mean-token-sum-norm" and cfg.algorithm.norm_tokens == 7
    cfg, _ = load_config(None, ["algorithm.mismatch.tis_cap=2"])
    assert cfg.algorithm.old_logprobs == "recompute"
    assert load_config(None, [])[0].algorithm.old_logprobs == "rollout"


@pytest.mark.parametrize("overrides,key", [
    (["algorithm.name=ppo2"], "algorithm.name"),
    (["algorithm.std=sample"], "algorithm.std"),
    (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c"),
    (["algorithm.clip_low=1.5"], "algorithm.clip_low"),
    (["algorithm.kl_in=penalty"], "algorithm.kl_in"),
    (["algorithm.mismatch.level=batch"], "algorithm.mismatch.level"),
    (["algorithm.mismatch.tis_cap=0.5"], "algorithm.mismatch.tis_cap"),
    (["algorithm.mismatch.tis_cap=2", "algorithm.old_logprobs=rollout"], "algorithm.old_logprobs"),
    (["algorithm.clip_high=lots"], "algorithm.clip_high"),
    (["algorithm.updates_per_step=0"], "algorithm.updates_per_step"),
])
def test_algorithm_config_errors_name_the_field(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value)
    assert err.value.key == key


def test_a_moved_algorithm_without_its_plugin_says_what_to_install_and_list(monkeypatch):
    import rlcore.manager as manager

    # installed here (the dev venv) but not listed in plugins:
    with pytest.raises(UnknownProviderError, match=r"plugin 'algorithms'.*installed but not active: add algorithms "
                                                   r"to the config's plugins: list") as err:
        load_config(None, ["algorithm.name=gspo"])
    assert err.value.key == "algorithm.name"
    # not installed at all: the pip line and the plugins: entry
    real = manager.discover_entry_points
    monkeypatch.setattr(manager, "discover_entry_points", lambda: {k: v for k, v in real().items() if k != "algorithms"})
    with pytest.raises(UnknownProviderError, match=r"not installed\. Install it with: pip install rlcore-algorithms, "
                                                   r"and add algorithms to the config's plugins: list") as err:
        load_config(None, ["algorithm.name=remax"])
    assert err.value.key == "algorithm.name"


# --------------------------------------------------------------------------------- hook -----

class _HalfREINFORCE:
    """A third-party loss for the hook test: ``pg = −A·logp/2``."""

    sequence_level = False

    def value(self, logprobs, x, seq_log_ratio=None):
        return -0.5 * x.advantages * logprobs

    def grad(self, logprobs, x, seq_log_ratio=None):
        return -0.5 * x.advantages * logprobs, -0.5 * x.advantages

    def metrics(self, logprobs, x, seq_log_ratio=None):
        return {}


def test_hook_algorithm(rlcore_plugin_manager, register_plugin):
    from dataclasses import dataclass

    @dataclass
    class Settings:
        scale: float = 1.0

    mod = types.ModuleType("halfpg")
    mod.PLUGIN_API = 1

    def algorithm():
        yield AlgorithmSpec(name="half-pg", settings=Settings, loss_agg="token-sum",
                            factory=lambda s: Algorithm(advantages=adv.DrGRPOAdvantage(), loss=_HalfREINFORCE()))

    mod.algorithm = hookimpl(algorithm)
    register_plugin(mod, "halfpg")
    algos = rlcore_plugin_manager.algorithms()
    assert {"grpo", "dr_grpo", "rloo", "ppo", "half-pg"} <= set(algos)
    assert algos["half-pg"].plugin == "halfpg"
    cfg, _ = load_config(None, ["algorithm.name=half-pg", "algorithm.scale=2"], plugins=rlcore_plugin_manager)
    assert cfg.algorithm.scale == 2.0 and cfg.algorithm.loss_agg == "token-sum"
    with pytest.raises(ConfigError, match="algorithm.clip_low"):
        load_config(None, ["algorithm.name=half-pg", "algorithm.clip_low=0.1"], plugins=rlcore_plugin_manager)
    built = algos["half-pg"].factory(cfg.algorithm)
    assert built.advantages(_inp([2.0, 0.0], [0, 0]))[0].tolist() == [1.0, 1.0]
    with pytest.raises(UnknownProviderError, match="algorithm.name"):
        rlcore_plugin_manager.select("algorithm", "nope", key="algorithm.name")


def test_algorithm_names_conflict_across_plugins(rlcore_plugin_manager, register_plugin):
    from rlcore.errors import PluginConflictError

    mod = types.ModuleType("dup")
    mod.PLUGIN_API = 1
    mod.algorithm = hookimpl(lambda: [AlgorithmSpec(name="grpo", factory=lambda s: None)])
    with pytest.raises(PluginConflictError, match="grpo"):
        register_plugin(mod, "dup")


def test_listing_algorithms_imports_no_torch():
    from rlcore.testing.imports import modules_loaded_by

    loaded = modules_loaded_by("import rlcore.builtin.algorithms, rlcore.algorithms, rlcore.config\n"
                               "list(rlcore.builtin.algorithms.algorithm())", ["torch"])
    assert loaded == []
