"""Core's machinery added in issue 30: the bounded and straight-through KL estimators, the rejection
of whole sequences by mismatch statistics and the adaptive KL controller, each against
hand-computed small cases and autograd; config errors name the key. (The estimators and losses
added then are rlcore-algorithms': plugins/algorithms/tests/test_algorithms_more.py.)"""

import math

import pytest
import torch
from rlcore.builtin.algorithms import algorithm
from rlcore.errors import ConfigError

SPECS = {s.name: s for s in algorithm()}


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
