"""The estimators and losses added for issue 30 (SAPO, GPG, clip-cov, KL-cov, GMPO, DPPO-TV/KL,
OPO, pass@k, ReMax), the bounded and straight-through KL estimators and the rejection of whole sequences
by mismatch statistics: each against hand-computed small cases and autograd; config errors name
the key; a few steps of each on the embedded default (examples/tiny.yaml)."""

import math

import pytest
import torch
from rlcore.algorithms.spec import AdvantageInput, TokenInputs
from rlcore.builtin.algorithms import algorithm
from rlcore.errors import ConfigError

SPECS = {s.name: s for s in algorithm()}
NEW = ("sapo", "gpg", "clip_cov", "kl_cov", "gmpo", "dppo_tv", "dppo_kl", "dro", "opo", "grpo_passk", "remax")


def _inputs(logp_old, adv, seq_index=None, mask=None):
    old = torch.tensor(logp_old, dtype=torch.float32)
    n = old.numel()
    seq_index = torch.zeros(n, dtype=torch.long) if seq_index is None else torch.tensor(seq_index)
    mask = torch.ones(n, dtype=torch.bool) if mask is None else torch.tensor(mask)
    nseq = int(seq_index.max()) + 1
    seq_tokens = torch.zeros(nseq).index_add_(0, seq_index, mask.float()).clamp_min(1.0)
    return TokenInputs(old_logprobs=old, rollout_logprobs=old, advantages=torch.tensor(adv, dtype=torch.float32),
                       mask=mask, weights=mask.float(), correction=None, ref_logprobs=None, seq_index=seq_index,
                       seq_tokens=seq_tokens)


def _autograd(loss, logp, x, slr=None):
    lp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    v = loss.value(lp, x, slr)
    (v * x.mask).sum().backward()
    return v.detach(), lp.grad


def _section(name, *over):
    from rlcore.testing.algorithm_conformance import algorithm_section

    return algorithm_section(SPECS[name], list(over))


def _built(name, *over):
    return SPECS[name].factory(_section(name, *over))


# ------------------------------------------------------------------------------ KL terms --

@pytest.mark.parametrize("est", ["k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+"])
@pytest.mark.parametrize("d", [-1e4, -50.0, 50.0, 1e4])
def test_kl_estimators_are_bounded_at_extreme_log_ratios(est, d):
    """d = ref − logp of ±50 and ±1e4 nats: the value and the gradient stay finite and within the
    documented bounds (|d| clamped to 20; k3's value to [0, 10]), by autograd and closed form."""
    from rlcore.algorithms.losses import KL_GRAD_BOUND, KL_VALUE_BOUND, kl_penalty, kl_value_and_grad

    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = logp.detach() + d
    v = kl_penalty(logp, ref, est)
    v.sum().backward()
    value, grad = kl_value_and_grad(logp.detach(), ref, est)
    for t in (v.detach(), logp.grad, value, grad):
        assert bool(torch.isfinite(t).all()), (est, d, t)
    assert float(value.abs().max()) <= KL_VALUE_BOUND[est.rstrip("+")]
    assert float(grad.abs().max()) <= KL_GRAD_BOUND[est]
    torch.testing.assert_close(grad, logp.grad)


def test_k3_value_and_gradient_by_hand_and_its_bound():
    from rlcore.algorithms.losses import kl_value_and_grad

    logp = torch.tensor([-1.0, -1.0, -1.0])
    ref = torch.tensor([-0.5, -1.0, 5.0])  # d = 0.5, 0, 6 (k3 = e^6 − 7 ≈ 396: clamped to 10)
    v, g = kl_value_and_grad(logp, ref, "k3")
    assert v.tolist() == pytest.approx([math.exp(0.5) - 1.5, 0.0, 10.0], rel=1e-6)
    assert g.tolist() == pytest.approx([1 - math.exp(0.5), 0.0, 0.0], rel=1e-6)
    v2, g2 = kl_value_and_grad(logp, ref, "low_var_kl")
    assert torch.equal(v, v2) and torch.equal(g, g2)


@pytest.mark.parametrize("est,base", [("k3+", "k3"), ("low_var_kl+", "k3"), ("k1+", "k1")])
def test_straight_through_kl_has_the_value_of_its_estimator_and_the_gradient_of_k2(est, base):
    from rlcore.algorithms.losses import kl_penalty, kl_value_and_grad

    logp = torch.tensor([-1.0, -0.2, -3.0], requires_grad=True)
    ref = torch.tensor([-0.5, -0.9, -2.0])
    v = kl_penalty(logp, ref, est)
    v.sum().backward()
    torch.testing.assert_close(v.detach(), kl_value_and_grad(logp.detach(), ref, base)[0])
    torch.testing.assert_close(logp.grad, -(ref - logp.detach()))  # ∂(d²/2)/∂logp = −d
    torch.testing.assert_close(kl_value_and_grad(logp.detach(), ref, est)[1], logp.grad)


def test_kl_estimator_choices_are_validated():
    from rlcore.testing.algorithm_conformance import algorithm_section

    assert algorithm_section(SPECS["grpo"], ["algorithm.kl_estimator=k3+", "algorithm.kl_coef=0.1"]).kl_estimator == "k3+"
    with pytest.raises(ConfigError, match="algorithm.kl_estimator"):
        algorithm_section(SPECS["grpo"], ["algorithm.kl_estimator=k4"])


# ------------------------------------------------------------------------------- losses --

def test_sapo_gate_by_hand():
    """pg = −A·(4/τ)·σ(τ(r−1)), τ = τ_pos for A > 0 else τ_neg; ∂pg/∂logp = −A·4σ(1−σ)·r."""
    loss = _built("sapo").loss
    x = _inputs([-1.0, -1.0], [1.0, -2.0])
    logp = [-1.0 + math.log(1.5), -1.0 + math.log(0.5)]
    v, g = _autograd(loss, logp, x)
    s1 = 1 / (1 + math.exp(-1.0 * 0.5))
    s2 = 1 / (1 + math.exp(-1.05 * -0.5))
    assert v.tolist() == pytest.approx([-1.0 * 4 / 1.0 * s1, 2.0 * 4 / 1.05 * s2], rel=1e-5)
    assert g.tolist() == pytest.approx([-1.0 * 4 * s1 * (1 - s1) * 1.5, 2.0 * 4 * s2 * (1 - s2) * 0.5], rel=1e-5)
    torch.testing.assert_close(loss.grad(torch.tensor(logp), x, None)[1], g)


def test_gpg_is_reinforce_on_the_log_prob():
    loss = _built("gpg").loss
    x = _inputs([-1.0, -2.0], [0.5, -1.5])
    v, g = _autograd(loss, [-0.7, -2.5], x)
    assert v.tolist() == pytest.approx([0.35, -3.75])
    assert g.tolist() == pytest.approx([-0.5, 1.5])


def test_gmpo_is_the_geometric_mean_of_sign_clipped_token_ratios():
    """One sequence of three tokens, A = 1, clip 0.4 (log space): log-ratios 0.1, 0.6 (clipped
    to 0.4, no gradient), −0.8 (A > 0: kept); seq ratio R = exp((0.1 + 0.4 − 0.8)/3); with
    seq-mean-token-mean the step loss is −A·R and ∂/∂logp_t = −A·R/3 where unclipped."""
    loss = _built("gmpo").loss
    x = _inputs([-1.0, -1.0, -1.0], [1.0, 1.0, 1.0])
    logp = [-0.9, -0.4, -1.8]
    v, g = _autograd(loss, logp, x)
    r = math.exp((0.1 + 0.4 - 0.8) / 3)
    assert v.tolist() == pytest.approx([-r] * 3, rel=1e-5)
    assert g.tolist() == pytest.approx([-r, 0.0, -r], rel=1e-5)  # weights 1/n_i make it −R/3
    x_neg = _inputs([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])  # A < 0: clip from below instead
    v, g = _autograd(loss, logp, x_neg)
    r = math.exp((0.1 + 0.6 - 0.4) / 3)
    assert v.tolist() == pytest.approx([r] * 3, rel=1e-5)
    assert g.tolist() == pytest.approx([r, r, 0.0], rel=1e-5)


def test_dppo_tv_and_kl_trust_regions_by_hand():
    """pg = −A·sg(min(r, c))·logp·valid; TV: valid where p − p_old ≤ δ_h (A > 0) / ≥ −δ_l
    (A ≤ 0); binary KL: where KL_bin(p_old‖p) ≤ δ or the move is away from the favoured side."""
    old = [math.log(0.5), math.log(0.5), math.log(0.5)]
    logp = [math.log(0.6), math.log(0.9), math.log(0.2)]
    x = _inputs(old, [1.0, 1.0, -1.0])
    tv = _built("dppo_tv", "algorithm.clip_low=0.2", "algorithm.clip_high=0.2").loss
    v, g = _autograd(tv, logp, x)
    # token 2: p − p_old = 0.4 > 0.2 for A > 0: outside; token 3: −0.3 < −0.2 for A < 0: outside
    assert g.tolist() == pytest.approx([-1.0 * 1.2, 0.0, 0.0], rel=1e-5)
    assert v.tolist() == pytest.approx([-1.2 * math.log(0.6), 0.0, 0.0], rel=1e-5)
    kl = _built("dppo_kl", "algorithm.clip_low=0.05", "algorithm.clip_high=0.05").loss

    def bkl(p_old, p):
        return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))
    assert bkl(0.5, 0.6) < 0.05 and bkl(0.5, 0.9) > 0.05 and bkl(0.5, 0.2) > 0.05
    _, g = _autograd(kl, logp, x)
    assert g.tolist() == pytest.approx([-1.2, 0.0, 0.0], rel=1e-5)
    # moving towards the disfavoured side is never masked: A > 0 with p < p_old
    x2 = _inputs([math.log(0.5)], [1.0])
    _, g = _autograd(kl, [math.log(0.05)], x2)
    assert g.tolist() == pytest.approx([-0.1], rel=1e-4)
    # the truncation c (clip_ratio_c, default 20) bounds the detached ratio
    _, g = _autograd(tv, [math.log(0.5)], _inputs([math.log(0.01)], [-1.0]))
    assert g.tolist() == pytest.approx([20.0], rel=1e-5)


def test_dro_quadratic_penalty_by_hand():
    loss = _built("dro", "algorithm.beta=2.0").loss
    x = _inputs([-1.0, -2.0], [0.5, -1.0])
    v, g = _autograd(loss, [-0.7, -2.5], x)
    assert v.tolist() == pytest.approx([0.35 + 0.3 ** 2, -2.5 + 0.5 ** 2])
    assert g.tolist() == pytest.approx([-0.5 + 2.0 * 0.3, 1.0 + 2.0 * -0.5])


def test_clip_cov_detaches_the_selected_high_covariance_tokens():
    """cov_t = (A_t − mean A)(logp_t − mean logp) over the tokens the loss sees; among unclipped
    tokens with lb < cov < ub, the max(1, ⌊ratio·N⌋) largest lose their gradient."""
    loss = _built("clip_cov", "algorithm.clip_cov_ratio=0.25", "algorithm.clip_cov_lb=0.5",
                  "algorithm.clip_cov_ub=5.0").loss
    adv = [2.0, 2.0, -2.0, -2.0, 0.0, 0.0, 0.0, 0.0]
    logp = [-0.1, -3.0, -3.0, -0.2, -1.0, -1.0, -1.0, -1.0]
    x = _inputs(logp, adv)  # ratio 1 everywhere: nothing clipped by PPO
    _, g = _autograd(loss, logp, x)
    m = sum(logp) / 8
    cov = [a * (lp - m) for a, lp in zip(adv, logp, strict=True)]
    chosen = sorted((c, i) for i, c in enumerate(cov) if 0.5 < c < 5.0)[-2:]
    want = [0.0 if any(i == j for _, j in chosen) else -a for i, a in enumerate(adv)]
    assert g.tolist() == pytest.approx(want)
    assert sum(1 for w in want if w == 0.0 and True) >= 2


def test_kl_cov_penalises_the_top_covariance_tokens():
    loss = _built("kl_cov", "algorithm.kl_cov_ratio=0.25", "algorithm.ppo_kl_coef=2.0").loss
    adv = [2.0, 2.0, -2.0, -2.0, 0.0, 0.0, 0.0, 0.0]
    old = [-0.1, -3.0, -3.0, -0.2, -1.0, -1.0, -1.0, -1.0]
    logp = [o + 0.1 for o in old]
    x = _inputs(old, adv)
    v, g = _autograd(loss, logp, x)
    m = sum(logp) / 8
    cov = [a * (lp - m) for a, lp in zip(adv, logp, strict=True)]
    top = set(sorted(range(8), key=lambda i: cov[i])[-2:])
    r = math.exp(0.1)
    for i in range(8):
        assert float(v[i]) == pytest.approx(-adv[i] * r + (2.0 * 0.1 if i in top else 0.0), rel=1e-5)
        assert float(g[i]) == pytest.approx(-adv[i] * r + (2.0 if i in top else 0.0), rel=1e-5)


# --------------------------------------------------------------------------- estimators --

def _adv_input(rewards, groups, lens):
    trs = []
    for r, n in zip(rewards, lens, strict=True):
        t = torch.zeros(n)
        t[-1] = r
        trs.append(t)
    return AdvantageInput(rewards=torch.tensor(rewards), groups=torch.tensor(groups), token_rewards=trs,
                          logprobs=[torch.zeros(n) for n in lens])


def test_opo_length_weighted_baseline_by_hand():
    inp = _adv_input([1.0, 0.0, 1.0, 5.0], [0, 0, 0, 1], [1, 3, 2, 4])
    adv = _built("opo").advantages(inp)
    b = (1 * 1 + 3 * 0 + 2 * 1) / 6
    assert [float(a[0]) for a in adv] == pytest.approx([1 - b, -b, 1 - b, 0.0])  # a group of one: 0
    assert [a.numel() for a in adv] == [1, 3, 2, 4]


def test_passk_gives_only_the_best_sample_the_gap_to_the_second():
    inp = _adv_input([0.0, 3.0, 1.0, 2.0, 2.0, 1.0], [0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1])
    adv = [float(a[0]) for a in _built("grpo_passk", "algorithm.std=none").advantages(inp)]
    assert adv == pytest.approx([0.0, 2.0, 0.0, 0.0, 0.0, 0.0])  # group 1: a tie at the top: gap 0
    adv = [float(a[0]) for a in _built("grpo_passk", "algorithm.std=unbiased").advantages(inp)]
    std = float(torch.tensor([0.0, 3.0, 1.0]).std())
    assert adv[1] == pytest.approx(2.0 / (std + 1e-6))


def test_remax_baseline_is_the_greedy_reward_of_the_prompt():
    """A_t = G_t − r_greedy: returns of the token rewards (KL penalty per token, outcome last)."""
    trs = [torch.tensor([-0.1, -0.1, 1.0]), torch.tensor([0.0, 0.5])]
    inp = AdvantageInput(rewards=torch.tensor([0.8, 0.5]), groups=torch.tensor([0, 1]), token_rewards=trs,
                         logprobs=[torch.zeros(3), torch.zeros(2)], baseline_rewards=torch.tensor([0.25, 1.0]))
    adv = _built("remax").advantages(inp)
    assert adv[0].tolist() == pytest.approx([0.8 - 0.25, 0.9 - 0.25, 1.0 - 0.25])
    assert adv[1].tolist() == pytest.approx([0.5 - 1.0, 0.5 - 1.0])
    with pytest.raises(ValueError, match="baseline_rewards"):
        _built("remax").advantages(_adv_input([1.0], [0], [1]))
    with pytest.raises(ConfigError, match="algorithm.dapo.dynamic_sampling.enable"):
        _section("remax", "algorithm.dapo.dynamic_sampling.enable=true")


def test_gpg_advantage_scales_by_the_fraction_of_nonzero_rewards():
    inp = _adv_input([1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1], [1, 1, 1, 1])
    adv = [float(a[0]) for a in _built("gpg").advantages(inp)]
    alpha = 4 / 1  # B / (number of samples with a nonzero reward)
    assert adv == pytest.approx([alpha * 0.5, -alpha * 0.5, 0.0, 0.0])


# --------------------------------------------------------------------- mismatch rejection --

#: the second sequence's d = p − q per token: 0, −1.5, +1.0, so k1 = −d: 0, 1.5, −1.0; k2 = d²/2:
#: 0, 1.125, 0.5; k3 = e^d − 1 − d: 0, 0.7231, 0.7183 (the first sequence's are all below 0.002)
SEQ2 = {"seq_max_k3": 0.7231, "seq_mean_k3": 0.4805, "seq_sum_k3": 1.4414, "seq_max_k2": 1.125,
        "seq_mean_k2": 0.5417, "seq_sum_k2": 1.625, "seq_sum_k1": 0.5, "seq_mean_k1": 0.1667}


@pytest.mark.parametrize("stat", sorted(SEQ2))
def test_sequences_are_rejected_by_their_mismatch_statistic(stat):
    """Threshold 0.6 (k1 statistics: on the absolute value): the second sequence is rejected
    (every token weight 0) exactly when its hand-computed statistic exceeds it."""
    from rlcore.algorithms.mismatch import MismatchCorrection, mismatch

    p = torch.tensor([-1.0, -1.0, -1.0, -2.5, 0.0])
    q = torch.tensor([-1.0, -1.05, -1.0, -1.0, -1.0])
    mask = torch.ones(5, dtype=torch.bool)
    seq = torch.tensor([0, 0, 1, 1, 1])
    res = mismatch(p, q, mask, seq, 2, MismatchCorrection(reject=stat, reject_max=0.6))
    kept = SEQ2[stat] <= 0.6
    assert res.correction.tolist() == [1.0, 1.0] + ([1.0] * 3 if kept else [0.0] * 3)
    assert res.metrics["mismatch/rejected_seq_frac"] == (0.0 if kept else 0.5)
    assert res.metrics["mismatch/reject_stat_max"] == pytest.approx(SEQ2[stat], abs=1e-4)


def test_rejection_combines_with_token_tis():
    from rlcore.algorithms.mismatch import MismatchCorrection, mismatch

    p = torch.tensor([-1.0, -0.5, -1.0, -2.5, 0.0])
    q = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    res = mismatch(p, q, torch.ones(5, dtype=torch.bool), torch.tensor([0, 0, 1, 1, 1]), 2,
                   MismatchCorrection(tis_cap=1.5, reject="seq_max_k2", reject_max=1.0))
    assert res.correction.tolist() == pytest.approx([1.0, 1.5, 0.0, 0.0, 0.0])


def test_mismatch_statistics_stay_finite_at_extreme_log_ratios():
    from rlcore.algorithms.mismatch import MismatchCorrection, mismatch

    p = torch.tensor([-1.0, 1e4, -1.0, -1e4])
    q = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    res = mismatch(p, q, torch.ones(4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]), 2,
                   MismatchCorrection(reject="seq_sum_k3", reject_max=5.0))
    assert all(math.isfinite(v) for k, v in res.metrics.items() if k.startswith("mismatch/reject"))
    assert res.correction.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rejection_settings_are_validated_and_turn_recompute_on():
    from rlcore.testing.algorithm_conformance import algorithm_section

    a = algorithm_section(SPECS["grpo"], ["algorithm.mismatch.reject=seq_max_k3", "algorithm.mismatch.reject_max=2"])
    assert a.old_logprobs == "recompute"
    with pytest.raises(ConfigError, match="algorithm.mismatch.reject"):
        algorithm_section(SPECS["grpo"], ["algorithm.mismatch.reject=seq_max_k1", "algorithm.mismatch.reject_max=2"])
    with pytest.raises(ConfigError, match="algorithm.mismatch.reject_max"):
        algorithm_section(SPECS["grpo"], ["algorithm.mismatch.reject=seq_max_k3"])


def test_new_settings_are_validated_naming_the_key():
    for name, bad in [("sapo", "algorithm.tau_pos=0"), ("clip_cov", "algorithm.clip_cov_ratio=0"),
                      ("kl_cov", "algorithm.kl_cov_ratio=2"), ("dppo_tv", "algorithm.clip_ratio_c=0.5"),
                      ("grpo_passk", "algorithm.std=sample"), ("gmpo", "algorithm.clip_low=-1")]:
        key = bad.split("=")[0]
        with pytest.raises(ConfigError, match=key):
            _section(name, bad)


# ---------------------------------------------------------------------- learning runs --

@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["algorithm.name=sapo", "algorithm.updates_per_step=2"],
    ["algorithm.name=gpg", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "algorithm.kl_control.target=0.01"],
    ["algorithm.name=clip_cov", "algorithm.updates_per_step=2"],
    ["algorithm.name=kl_cov", "algorithm.updates_per_step=2"],
    ["algorithm.name=gmpo", "algorithm.updates_per_step=2", "training.micro_batch_tokens=64"],
    ["algorithm.name=dppo_tv", "algorithm.updates_per_step=2"],
    ["algorithm.name=dppo_kl", "algorithm.kl_coef=0.05", "algorithm.kl_estimator=k3+"],
    ["algorithm.name=opo"],
    ["algorithm.name=dro", "algorithm.updates_per_step=2"],
    ["algorithm.name=grpo_passk", "algorithm.mismatch.reject=seq_max_k3", "algorithm.mismatch.reject_max=1"],
    ["algorithm.name=remax", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward"],
])
def test_new_algorithms_train_on_the_embedded_default(tmp_path, overrides):
    from pathlib import Path

    from rlcore.run_output import read_metrics
    from rlcore.stack import load_config, resolve
    from rlcore.trainer import Trainer

    root = Path(__file__).resolve().parents[2]
    cfg, pm = load_config(root / "examples" / "tiny.yaml",
                          ["training.steps=2", "data.prompts_per_step=8", *overrides, f"output.dir={tmp_path}",
                           "output.plot=false", "output.tensorboard=false", "output.progress=false",
                           "output.checkpoint_every=0"])
    Trainer(resolve(cfg, pm)).run()
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
    if any("reject" in o for o in overrides):
        assert "mismatch/rejected_seq_frac" in rows[0]
    if any("remax" in o for o in overrides):  # one greedy response per prompt, scored, each step
        assert all(0.0 <= r["remax/greedy_reward_mean"] <= 1.0 and r["remax/greedy_seconds"] > 0 for r in rows)
    if any("kl_control" in o for o in overrides):  # KL in the reward, adaptive β (0 KL at step 0: it shrinks)
        assert rows[0]["kl_control/beta"] < 0.05 and "kl_reward_penalty" in rows[1]


# ------------------------------------------------------------------- adaptive KL control --

def test_adaptive_kl_controller_by_hand():
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (verl's AdaptiveKLController)."""
    from rlcore.algorithms.kl_control import KLControl

    c = KLControl(0.1, target=0.02, horizon=100)
    assert c.update(0.05, n_steps=10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped at +0.2
    b = c.beta
    assert c.update(0.019, n_steps=10) == pytest.approx(b * (1 + (0.019 / 0.02 - 1) * 10 / 100))
    fixed = KLControl(0.1)
    assert fixed.update(5.0, n_steps=10) == 0.1 and not fixed.adaptive


def test_kl_control_settings_are_validated():
    from rlcore.testing.algorithm_conformance import algorithm_section

    with pytest.raises(ConfigError, match="algorithm.kl_control.target"):
        algorithm_section(SPECS["grpo"], ["algorithm.kl_control.target=0.1"])  # kl_coef 0: nothing to adapt
    with pytest.raises(ConfigError, match="algorithm.kl_control.horizon"):
        algorithm_section(SPECS["grpo"], ["algorithm.kl_coef=0.1", "algorithm.kl_control.target=0.1",
                                          "algorithm.kl_control.horizon=0"])
    a = algorithm_section(SPECS["grpo"], ["algorithm.kl_coef=0.1", "algorithm.kl_control.target=0.1"])
    assert a.kl_control.target == 0.1


@pytest.mark.slow
def test_adaptive_kl_adapts_beta_and_resumes_with_it(tmp_path, kl_in="loss"):
    """β moves every step by verl's rule and the KL term uses it; killed at step 3's rollout and resumed from step 1's checkpoint, the
    resumed steps equal the uninterrupted run's (β, loss, KL), as the checkpoint holds β."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from rlcore.cli import main
    from rlcore.run_output import read_metrics

    tiny = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
    common = ["training.steps=4", "output.checkpoint_every=2", "data.prompts_per_step=4", "rollout.n=4",
              "algorithm.kl_coef=0.1", "algorithm.kl_control.target=1e-9", "algorithm.kl_control.horizon=20",
              f"algorithm.kl_in={kl_in}", "algorithm.updates_per_step=2", "output.plot=false",
              "output.progress=false", "output.tensorboard=false"]
    assert main(["train", tiny, "--output", str(tmp_path / "full"), *common]) == 0
    full = read_metrics(tmp_path / "full")
    betas = [r["kl_control/beta"] for r in full]
    # step 0 samples from the reference itself: KL 0 < target, β shrinks by the capped 20 %·n/horizon
    # (n = 16 samples); from step 1 on KL > 1e-9: it grows by as much each step
    assert full[0]["kl_control/kl"] == 0.0 and betas[0] == pytest.approx(0.1 * (1 - 0.2 * 16 / 20))
    for i in range(1, len(full)):
        assert full[i]["kl_control/kl"] > 0 and betas[i] == pytest.approx(betas[i - 1] * (1 + 0.2 * 16 / 20))
    cut = tmp_path / "cut"
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", tiny, "--output", str(cut), *common],
                          env=dict(os.environ, RLCORE_FAULT="rollout:4"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert main(["train", tiny, "--output", str(cut), "--resume", *common]) == 0
    resumed = read_metrics(cut)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(full[2:], resumed[2:], strict=True):
        for key in ("kl_control/beta", "kl_control/kl", "loss", "grad_norm", "reward_mean"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} != {b[key]}"


@pytest.mark.parametrize("est", ["k1", "k2", "k3", "low_var_kl+", "k3+"])
@pytest.mark.parametrize("shift", [-1e4, -50.0, 50.0, 1e4])
def test_the_step_objective_with_kl_stays_finite_at_extreme_reference_gaps(est, shift):
    """The whole per-token objective (PPO-clip + β·KL + entropy), the reference ±50 / ±1e4 nats
    away: loss and gradient finite by autograd (the trainer's path) and in closed form (a fused
    head's), and equal."""
    from rlcore.algorithms import PPOClip
    from rlcore.algorithms.losses import TokenObjective
    from rlcore.testing.algorithm_conformance import closed_form_step, random_step, step_loss

    batch = random_step(7)
    batch.fields["ref_logprobs"] = batch.fields["ref_logprobs"] + shift
    obj = TokenObjective(PPOClip(0.2, 0.28, 3.0), kl_coef=0.1, kl_estimator=est, entropy_coef=0.01)
    loss, d_logp, _ = step_loss(batch, obj, "token-mean", micro_batch_tokens=10 ** 6)
    closed, c_logp, _ = closed_form_step(batch, obj, "token-mean")
    assert math.isfinite(loss) and bool(torch.isfinite(d_logp).all())
    assert closed == pytest.approx(loss, rel=1e-5) and c_logp.tolist() == pytest.approx(d_logp.tolist(), abs=1e-6)
