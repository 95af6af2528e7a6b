"""The optimal-token baseline (algorithm.name=optimal_token_baseline, verl's
compute_optimal_token_baseline_advantage): the estimator by hand and against a plain reference
loop, Σπ² from the reference head against float64, the trainer's plumbing of Σπ² from the
old-log-prob pass, config errors naming the key, a head without Σπ² refused at config time, and a
learning run on the embedded default."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch
from rlcore import hookimpl
from rlcore.algorithms import AdvantageInput
from rlcore.errors import ConfigError, MissingCapabilityError
from rlcore.stack import load_config, load_stack, resolve
from rlcore.testing.runs import read_metrics
from rlcore.types import Cap, ForwardFnSpec
from rlcore_algorithms import plugin
from rlcore_algorithms.token_baseline import OptimalTokenBaselineAdvantage

TINY = str(Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml")
QUIET = ["output.plot=false", "output.tensorboard=false", "output.progress=false", "output.checkpoint_every=0"]


def _inp(token_rewards, groups, pi, sum_sq, correction=None) -> AdvantageInput:
    tr = [torch.tensor(t, dtype=torch.float32) for t in token_rewards]
    lp = [torch.tensor(p, dtype=torch.float32).log() for p in pi]
    return AdvantageInput(rewards=torch.tensor([float(t.sum()) for t in tr]), groups=torch.tensor(groups),
                          token_rewards=tr, logprobs=lp, recomputed_logprobs=lp,
                          sum_pi_squared=[torch.tensor(s, dtype=torch.float32) for s in sum_sq],
                          correction=None if correction is None else [torch.tensor(c) for c in correction])


# group 0: sample A (2 tokens, reward 1), sample B (3 tokens, reward 2); group 1: one sample.
# w = 1 − 2π + Σπ²: A (π, Σπ²) = (.5, .5), (.25, .5) -> w = .5, 1;  B: (.25, .5), (.5, .5), (.75, .75)
# -> w = 1, .5, .25.  W (cumulative): A .5, 1.5;  B 1, 1.5, 1.75.  G: A 1, 1;  B 2, 2, 2.
# B_0 = (1·.5 + 2·1)/(.5 + 1) = 5/3;  B_1 = (1·1.5 + 2·1.5)/3 = 1.5;  B_2 = 2·1.75/1.75 = 2 (B alone)
CASE = _inp([[0, 1], [0, 0, 2], [0, 3]], [0, 0, 1],
            pi=[[.5, .25], [.25, .5, .75], [.5, .5]], sum_sq=[[.5, .5], [.5, .5, .75], [.5, .5]])


def test_hand_computed_case():
    a, b, single = OptimalTokenBaselineAdvantage()(CASE)
    assert a.tolist() == pytest.approx([1 - 5 / 3, 1 - 1.5], abs=1e-6)
    assert b.tolist() == pytest.approx([2 - 5 / 3, 2 - 1.5, 0.0], abs=1e-6)
    assert single.tolist() == [0.0, 0.0]  # a group of one sample: no baseline to compare with


def test_handle_zero_tail_gives_the_lone_longest_tail_its_return():
    a, b, _ = OptimalTokenBaselineAdvantage(handle_zero_tail=True)(CASE)
    assert a.tolist() == pytest.approx([1 - 5 / 3, 1 - 1.5], abs=1e-6)
    assert b.tolist() == pytest.approx([2 - 5 / 3, 2 - 1.5, 2.0], abs=1e-6)  # past A's length: baseline 0


def test_mismatch_correction_scales_each_tokens_energy_by_its_weight_squared():
    # B's first token weighted 2 (w 1 -> 4): W_B = 4, 4.5, 4.75; B_0 = (.5 + 2·4)/4.5, B_1 = (1.5 + 2·4.5)/6
    inp = _inp([[0, 1], [0, 0, 2]], [0, 0], pi=[[.5, .25], [.25, .5, .75]], sum_sq=[[.5, .5], [.5, .5, .75]],
               correction=[[1.0, 1.0], [2.0, 1.0, 1.0]])
    a, b = OptimalTokenBaselineAdvantage()(inp)
    assert a.tolist() == pytest.approx([1 - 8.5 / 4.5, 1 - 10.5 / 6], abs=1e-6)
    assert b.tolist() == pytest.approx([2 - 8.5 / 4.5, 2 - 10.5 / 6, 0.0], abs=1e-6)


def _reference_loop(inp: AdvantageInput, eps: float = 1e-8, zero_tail: bool = False) -> list[list[float]]:
    """verl's formula written out with Python floats, one position at a time."""
    lens = inp.response_lengths
    G = [[sum(float(x) for x in inp.token_rewards[i][t:]) for t in range(n)] for i, n in enumerate(lens)]
    W = []
    for i, n in enumerate(lens):
        acc, row = 0.0, []
        for t in range(n):
            w = 1 - 2 * math.exp(float(inp.recomputed_logprobs[i][t])) + float(inp.sum_pi_squared[i][t])
            if inp.correction is not None:
                w *= float(inp.correction[i][t]) ** 2
            acc += w
            row.append(acc)
        W.append(row)
    out = [[0.0] * n for n in lens]
    for g in set(inp.groups.tolist()):
        members = [i for i in range(len(lens)) if int(inp.groups[i]) == g and lens[i] > 0]
        if len(members) < 2:
            continue
        ordered = sorted(lens[i] for i in members)
        for i in members:
            for t in range(lens[i]):
                num = sum(G[j][t] * W[j][t] for j in members if lens[j] > t)
                den = sum(W[j][t] for j in members if lens[j] > t)
                base = num / (den + eps)
                if zero_tail and lens[i] == ordered[-1] > ordered[-2] and t >= ordered[-2]:
                    base = 0.0
                out[i][t] = G[i][t] - base
    return out


@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_a_plain_reference_loop(seed, zero_tail):
    g = torch.Generator().manual_seed(seed)
    n = 13
    lens = torch.randint(0, 7, (n,), generator=g).tolist()
    lens[0] = 0  # a response with no loss tokens (overlong-filtered)
    groups = (torch.arange(n) // 4).tolist()  # the last group holds one sample
    token_rewards, pi, sum_sq, corr = [], [], [], []
    for m in lens:
        tr = -0.05 * torch.rand(m, generator=g)  # a per-token KL penalty ...
        if m:
            tr[-1] += float(torch.randint(0, 2, (1,), generator=g))  # ... and the outcome on the last token
        p = torch.rand(m, generator=g) * 0.98 + 0.01
        token_rewards.append(tr.tolist())
        pi.append(p.tolist())
        sum_sq.append((p ** 2 + (1 - p) ** 2 * torch.rand(m, generator=g)).tolist())
        corr.append((torch.rand(m, generator=g) * 2).tolist())
    for correction in (None, corr):
        inp = _inp(token_rewards, groups, pi, sum_sq, correction)
        got = OptimalTokenBaselineAdvantage(handle_zero_tail=zero_tail)(inp)
        want = _reference_loop(inp, zero_tail=zero_tail)
        assert [x.shape[0] for x in got] == lens
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.tolist() == pytest.approx(b, abs=1e-5), f"sample {i}"


def test_without_sum_pi_squared_the_estimator_says_what_is_missing():
    inp = AdvantageInput(rewards=torch.ones(2), groups=torch.zeros(2, dtype=torch.long),
                         token_rewards=[torch.ones(1), torch.ones(1)], logprobs=[torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError, match="sum_pi_squared"):
        OptimalTokenBaselineAdvantage()(inp)


# -------------------------------------------------------------------------- config and trainer --

@pytest.mark.parametrize(("override", "key"), [
    ("algorithm.eps=0", "algorithm.eps"),
    ("algorithm.handle_zero_tail=sometimes", "algorithm.handle_zero_tail"),
    ("algorithm.clip_low=1.5", "algorithm.clip_low"),
])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_stack(TINY, ["plugins=[algorithms]", "algorithm.name=optimal_token_baseline", override])
    assert err.value.key == key


def test_a_head_without_sum_pi_squared_is_refused_at_config_time(rlcore_plugin_manager, register_plugin):
    mod = types.ModuleType("plainhead")
    mod.PLUGIN_API = 1
    mod.forward_fn = hookimpl(lambda: [ForwardFnSpec(name="plain", factory=lambda ctx: None,
                                                     capabilities={Cap.ENTROPY, Cap.VOCAB_PARALLEL})])
    register_plugin(mod, "plainhead")
    register_plugin(plugin, "algorithms")
    cfg, pm = load_config(TINY, ["algorithm.name=optimal_token_baseline", "forward.name=plain"],
                          plugins=rlcore_plugin_manager)
    with pytest.raises(MissingCapabilityError, match="sum_pi_squared") as err:
        resolve(cfg, pm)
    assert "'plain'" in str(err.value) and "algorithm.name=optimal_token_baseline" in str(err.value)
    cfg, pm = load_config(TINY, ["forward.name=plain"], plugins=rlcore_plugin_manager)
    resolve(cfg, pm)  # grpo does not need it


@pytest.mark.parametrize("mismatch", [[], ["algorithm.mismatch.tis_cap=2"]])
def test_the_trainer_fills_sum_pi_squared_from_the_old_logprob_pass(tmp_path, rlcore_plugin_manager, register_plugin,
                                                                    mismatch):
    """A recording estimator under the built-in spec's needs: Σπ² arrives per sample, aligned with the
    trainer's recomputed log-probs (π(label)² ≤ Σπ² ≤ 1), which equal the rollout's (same policy); with
    the mismatch correction on, its weights come per sample too (verl scales w by them squared)."""
    from rlcore.algorithms import PPOClip
    from rlcore.testing.runs import Trainer
    from rlcore.types import Algorithm, AlgorithmSpec

    seen = []

    class Recording(OptimalTokenBaselineAdvantage):
        def __call__(self, inp):
            seen.append(inp)
            return super().__call__(inp)

    mod = types.ModuleType("otbrec")
    mod.PLUGIN_API = 1
    mod.algorithm = hookimpl(lambda: [AlgorithmSpec(
        name="otb-recorder", head_needs=frozenset({Cap.SUM_PI_SQUARED}),
        factory=lambda s: Algorithm(advantages=Recording(), loss=PPOClip(), token_level_rewards=True))])
    register_plugin(mod, "otbrec")
    cfg, pm = load_config(TINY, ["algorithm.name=otb-recorder", "training.steps=1", "data.prompts_per_step=4",
                                 "rollout.n=4", "rollout.temperature=0.7", f"output.dir={tmp_path}", *QUIET,
                                 *mismatch],
                          plugins=rlcore_plugin_manager)
    assert Trainer(resolve(cfg, pm)).run()["completed"]
    (inp,) = seen
    assert inp.sum_pi_squared is not None and len(inp.sum_pi_squared) == 16
    for sq, lp, rollout in zip(inp.sum_pi_squared, inp.recomputed_logprobs, inp.logprobs, strict=True):
        assert sq.shape == lp.shape == rollout.shape
        assert bool((sq <= 1 + 1e-6).all()) and bool((sq + 1e-6 >= lp.exp() ** 2).all())
        torch.testing.assert_close(lp, rollout, atol=1e-4, rtol=0)  # the sampling policy's own pass
    if mismatch:  # TIS weights min(ratio, 2): the same policy on both sides, so ~1
        assert [c.shape for c in inp.correction] == [lp.shape for lp in inp.recomputed_logprobs]
        assert all(bool(((c - 1).abs() < 1e-3).all()) for c in inp.correction)
    else:
        assert inp.correction is None


@pytest.mark.slow
def test_optimal_token_baseline_learns_on_the_embedded_default(tmp_path):
    """~30 steps of the successor task from chance level (docs/algorithms/curves_more.png has 40)."""
    from rlcore.testing.runs import main

    assert main(["train", TINY, "--output", str(tmp_path), "plugins=[algorithms]", "algorithm.name=optimal_token_baseline",
                 "training.steps=30", *QUIET]) == 0
    rows = read_metrics(tmp_path)
    assert len(rows) == 30 and all(math.isfinite(r["loss"]) for r in rows)
    start = sum(r["reward_mean"] for r in rows[:5]) / 5
    end = sum(r["reward_mean"] for r in rows[-5:]) / 5
    print(f"optimal_token_baseline reward {start:.3f} (first 5 steps) -> {end:.3f} (last 5)")
    assert start < 0.2 and end > start + 0.1
