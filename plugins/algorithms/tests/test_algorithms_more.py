"""rlcore-algorithms' estimators and losses added in issue 30 (SAPO, GPG, Clip-Cov, KL-Cov, GMPO,
DPPO-TV/KL, DRO, OPO, pass@k, ReMax) and the earlier REINFORCE++, GSPO and CISPO, each against
hand-computed small cases and autograd; config errors name the key; a few steps of each on the
embedded default (examples/tiny.yaml, with ``plugins=[algorithms]``)."""

import math

import pytest
import torch
from rlcore.algorithms import AdvantageInput, TokenInputs
from rlcore.errors import ConfigError
from rlcore_algorithms.advantages import ReinforcePPAdvantage, ReinforcePPBaselineAdvantage
from rlcore_algorithms.losses import CISPO, GSPO
from rlcore_algorithms.plugin import algorithm

SPECS = {s.name: s for s in algorithm()}
#: what a config needs to select one of this plugin's algorithms
ACTIVE = "plugins=[algorithms]"


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
    ["algorithm.name=gspo"],
    ["algorithm.name=cispo", "algorithm.entropy_coef=0.01", "algorithm.updates_per_step=2"],
    ["algorithm.name=reinforce_pp", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "algorithm.kl_estimator=k1"],
])
def test_new_algorithms_train_on_the_embedded_default(tmp_path, overrides):
    from pathlib import Path

    from rlcore.stack import load_config, resolve
    from rlcore.testing.runs import Trainer, read_metrics

    root = Path(__file__).resolve().parents[3]
    cfg, pm = load_config(root / "examples" / "tiny.yaml",
                          [ACTIVE, "training.steps=2", "data.prompts_per_step=8", *overrides, f"output.dir={tmp_path}",
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
    if "algorithm.name=cispo" in overrides:  # the second update sees ratios != 1
        assert any(row["ratio"] != 1.0 for row in rows)
    if "algorithm.name=reinforce_pp" in overrides:
        assert "kl_reward_penalty" in rows[0]
    if any("kl_control" in o for o in overrides):  # KL in the reward, adaptive β (0 KL at step 0: it shrinks)
        assert rows[0]["kl_control/beta"] < 0.05 and "kl_reward_penalty" in rows[1]


# ------------------------------------------------------- REINFORCE++, GSPO, CISPO (issue 12) --

def test_reinforce_pp_returns_and_global_whitening():
    a = ReinforcePPAdvantage(gamma=1.0)(_adv_input([1.0, 0.0], [0, 1], [2, 3]))
    # returns [[1, 1], [0, 0, 0]]: mean 0.4, population var 0.24
    sd = math.sqrt(0.24 + 1e-8)
    assert a[0].tolist() == pytest.approx([0.6 / sd] * 2)
    assert a[1].tolist() == pytest.approx([-0.4 / sd] * 3)
    inp = AdvantageInput(torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), [torch.tensor([0.0, 1.0]), torch.tensor([0.0])],
                         [torch.zeros(2), torch.zeros(1)])
    g = ReinforcePPAdvantage(gamma=0.5)(inp)
    # returns [[0.5, 1.0], [0.0]]
    vals = torch.tensor([0.5, 1.0, 0.0])
    expect = (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=False) + 1e-8)
    assert torch.cat(g).tolist() == pytest.approx(expect.tolist())


def test_reinforce_pp_baseline():
    a = ReinforcePPBaselineAdvantage()(_adv_input([1.0, 0.0], [0, 0], [2, 1]))
    # returns minus the group mean 0.5: [0.5, 0.5], [-0.5]; mean 1/6, population std sqrt(2/9)
    sd = math.sqrt(2 / 9 + 1e-8)
    assert torch.cat(a).tolist() == pytest.approx([(1 / 3) / sd, (1 / 3) / sd, (-2 / 3) / sd], rel=1e-5)


def test_gspo_sequence_ratio_and_its_sequence_level_gradient():
    # two sequences: log-ratios [0.1, 0.3] (mean 0.2) and [-0.2]
    logp, x = torch.tensor([0.1, 0.3, -0.2]), _inputs([0.0, 0.0, 0.0], [1.0, 1.0, -0.5], seq_index=[0, 0, 1])
    slr = torch.tensor([0.2, 0.2, -0.2])
    pg, g = GSPO(0.3, 0.3).grad(logp, x, slr)
    s0, s1 = math.exp(0.2), math.exp(-0.2)
    assert pg.tolist() == pytest.approx([-s0, -s0, 0.5 * s1], rel=1e-6)
    assert g.tolist() == pytest.approx([-s0, -s0, 0.5 * s1], rel=1e-6)
    # GSPO's sequence objective (1/G) Σ_i max(-A s_i, -A clip(s_i)), s_i = exp(mean log-ratio),
    # has the same gradient as GSPO-token under seq-mean-token-mean
    lp = logp.clone().requires_grad_(True)
    seq0, seq1 = torch.exp(lp[:2].mean()), torch.exp(lp[2:].mean())
    loss = (torch.maximum(-1.0 * seq0, -1.0 * seq0.clamp(0.7, 1.3))
            + torch.maximum(0.5 * seq1, 0.5 * seq1.clamp(0.7, 1.3))) / 2
    loss.backward()
    w = torch.tensor([1 / 4, 1 / 4, 1 / 2])  # 1 / (seqs · tokens of the seq)
    torch.testing.assert_close(w * g, lp.grad)
    clipped, _ = GSPO(3e-4, 4e-4).grad(logp, x, slr)
    assert float(clipped[0]) == pytest.approx(-(1 + 4e-4))


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    logp, x = torch.tensor([-0.5, -0.5]), _inputs([-0.5 - math.log(1.5), -0.5], [2.0, 2.0])  # ratios 1.5 and 1
    pg, g = CISPO(1.0, 0.28).grad(logp, x)
    assert pg.tolist() == pytest.approx([-1.28 * 2 * -0.5, -1.0 * 2 * -0.5], rel=1e-6)
    assert g.tolist() == pytest.approx([-2.56, -2.0], rel=1e-6)  # PPO would give 0 for the first


def test_config_selects_a_plugin_algorithm_with_its_published_aggregation():
    from rlcore.stack import load_config

    cfg, _ = load_config(None, [ACTIVE, "algorithm.name=gspo"])
    assert cfg.algorithm.loss_agg == "seq-mean-token-mean" and cfg.algorithm.clip_high == pytest.approx(4e-4)


@pytest.mark.parametrize("overrides,key", [
    (["algorithm.name=gspo", "algorithm.clip_ratio_c=3"], "algorithm.clip_ratio_c"),
    (["algorithm.name=gspo", "algorithm.advantage=ppo"], "algorithm.advantage"),
    (["algorithm.name=reinforce_pp", "algorithm.gamma=0"], "algorithm.gamma"),
])
def test_config_errors_name_the_field(overrides, key):
    from rlcore.stack import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, [ACTIVE, *overrides])
    assert key in str(err.value)
    assert err.value.key == key


def test_remax_is_refused_with_a_multi_turn_environment():
    """ReMax's greedy baseline is one completion per prompt: its spec declares single_turn."""
    from pathlib import Path

    from rlcore.stack import load_stack

    tiny = str(Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml")
    assert SPECS["remax"].single_turn and not any(s.single_turn for n, s in SPECS.items() if n != "remax")
    with pytest.raises(ConfigError, match="remax is single-turn only") as err:
        load_stack(tiny, [ACTIVE, "environment.name=tools", "algorithm.name=remax"])
    assert err.value.key == "environment.name"


def test_every_algorithm_here_is_one_core_names_in_its_hint_table():
    """core's error for ``algorithm.name: gspo`` without this plugin comes from its table of the
    algorithms that moved here (rlcore.discovery.MOVED_ALGORITHMS): the two lists are the same."""
    from rlcore.discovery import MOVED_ALGORITHMS

    assert sorted(SPECS) == sorted(MOVED_ALGORITHMS)
