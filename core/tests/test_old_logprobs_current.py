"""``algorithm.old_logprobs: current``: the ratio's denominator is the train forward's own
log-probs (detached) and the token-level mismatch weights are computed from them inside the
loss, so the trainer skips the no-grad pass. With one optimizer step per batch that is what the
recomputation gives; these tests check the loss, its gradient and a whole run against
``recompute``, and that the settings it cannot serve are refused naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rlcore.algorithms import objective as objmod
from rlcore.algorithms.losses import PPOClip, TokenObjective
from rlcore.algorithms.mismatch import MismatchCorrection, mismatch, token_weights
from rlcore.errors import ConfigError
from rlcore.stack import load_config

ROOT = Path(__file__).resolve().parents[2]
RECOMPUTED = "recomputed_logprobs"


class MB:
    """Two sequences, six tokens, one of them without loss; rollout log-probs off the trainer's
    by up to ±0.4 so that the cap and the masks act."""

    def __init__(self, current: torch.Tensor):
        g = torch.Generator().manual_seed(3)
        self.loss_mask = torch.tensor([True, True, True, False, True, True])
        self.index = torch.tensor([0, 0, 0, 1, 1, 1])
        rollout = current.detach() + torch.tensor([0.4, -0.3, 0.05, 0.0, -0.4, 0.2])
        self.fields = {"old_logprobs": rollout, "advantages": torch.randn(6, generator=g),
                       "agg_numerator": self.loss_mask.float(), RECOMPUTED: current.detach().clone()}

    def seq_index(self):
        return self.index

    def seq_sum(self, v):
        return torch.zeros(2, dtype=v.dtype).index_add_(0, self.index, v)


CORRECTIONS = [MismatchCorrection("token", tis_cap=1.2), MismatchCorrection("token", mask_low=0.8, mask_high=1.3),
               MismatchCorrection("token", tis_cap=1.2, mask_high=1.45), MismatchCorrection()]


@pytest.mark.parametrize("correction", CORRECTIONS, ids=lambda c: f"cap{c.tis_cap}-lo{c.mask_low}-hi{c.mask_high}")
def test_current_gives_the_recomputed_loss_and_gradient(correction):
    objective = TokenObjective(PPOClip(0.2, 0.28))
    results = []
    for proximal in (RECOMPUTED, objmod.CURRENT):
        lp = torch.tensor([-1.0, -2.0, -0.5, 0.0, -1.5, -0.7], requires_grad=True)
        mb = MB(lp)
        if proximal == RECOMPUTED:  # the step-level weights, as the trainer fills them before the pass
            mm = mismatch(lp.detach(), mb.fields["old_logprobs"], mb.loss_mask, mb.index, 2, correction)
            if mm.correction is not None:
                mb.fields[objmod.CORRECTION] = mm.correction
        loss, stats = objmod.micro_batch_loss(mb, lp, None, objective, 5.0, proximal, correction=correction)
        loss.backward()
        results.append((loss.detach(), lp.grad.clone(), stats))
    (loss_r, grad_r, stats_r), (loss_c, grad_c, stats_c) = results
    assert torch.allclose(loss_c, loss_r, rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad_c, grad_r, rtol=1e-6, atol=1e-7)
    assert stats_c["ratio"] == pytest.approx(stats_r["ratio"], rel=1e-6)
    if correction.active:  # the weights did something: not all ones
        base = MB(torch.zeros(6))
        w = token_weights(torch.zeros(6), base.fields["old_logprobs"], base.loss_mask, correction)
        assert not torch.allclose(w[base.loss_mask], torch.ones(5))


def test_token_weights_are_the_step_weights_of_a_token_level_correction():
    g = torch.Generator().manual_seed(0)
    trainer, rollout = torch.randn(40, generator=g) * 0.3 - 1.0, torch.randn(40, generator=g) * 0.3 - 1.0
    mask = torch.rand(40, generator=g) > 0.2
    seq = torch.arange(40) // 10
    for c in CORRECTIONS[:3]:
        step = mismatch(trainer, rollout, mask, seq, 4, c).correction
        per_token = token_weights(trainer, rollout, mask, c)
        assert torch.allclose(per_token, step)
        # chunk by chunk (what a fused head does) is the same
        chunks = torch.cat([token_weights(trainer[i:i + 7], rollout[i:i + 7], mask[i:i + 7], c) for i in range(0, 40, 7)])
        assert torch.allclose(chunks, step)
    with pytest.raises(ValueError, match="not per token"):
        token_weights(trainer, rollout, mask, MismatchCorrection("sequence", tis_cap=2.0))


def test_a_head_that_skips_inputs_for_gets_a_non_finite_loss():
    """The NaN denominator makes a head that ignores ``LossRequest.complete`` fail loudly."""
    lp = torch.tensor([-1.0, -2.0, -0.5, 0.0, -1.5, -0.7])
    mb = MB(lp)
    req = objmod.loss_request(mb, TokenObjective(PPOClip()), 5.0, objmod.CURRENT, MismatchCorrection("token", tis_cap=2))
    assert bool(torch.isnan(req.inputs.old_logprobs).all())
    ignored = req.objective.closed_form(lp, torch.zeros(6), req.inputs)
    assert not bool(torch.isfinite(ignored.value[mb.loss_mask]).all())
    done = req.objective.closed_form(lp, torch.zeros(6), req.inputs_for(req.inputs, lp))
    assert bool(torch.isfinite(done.value).all()) and done.value.sum() != 0
    sub = req.inputs_at(torch.tensor([4, 0]))
    assert torch.equal(req.inputs_for(sub, lp[[4, 0]]).old_logprobs, lp[[4, 0]])


def _run(tmp_path: Path, overrides: list[str]):
    from rlcore.run_output import read_metrics
    from rlcore.stack import resolve
    from rlcore.trainer import Trainer

    cfg, pm = load_config(ROOT / "examples" / "tiny.yaml",
                          [*overrides, f"output.dir={tmp_path}", "output.plot=false", "output.tensorboard=false",
                           "output.progress=false", "output.checkpoint_every=0", "training.steps=3"])
    Trainer(resolve(cfg, pm)).run()
    return read_metrics(tmp_path)


@pytest.mark.slow
def test_a_run_with_current_equals_one_with_recompute_without_the_pass(tmp_path):
    """Same seed, TIS on: the same samples, losses and gradient norms (within the no-grad vs
    training forward's kernel difference, ~1e-7 relative on CPU: docs of
    test_algorithms_trainer), and no old-log-prob pass."""
    common = ["algorithm.mismatch.tis_cap=2", "training.micro_batch_tokens=48"]
    recompute = _run(tmp_path / "recompute", [*common, "algorithm.old_logprobs=recompute"])
    current = _run(tmp_path / "current", [*common, "algorithm.old_logprobs=current"])
    assert len(recompute) == len(current) == 3
    for a, b in zip(recompute, current, strict=True):
        assert "old_logprob_seconds" in a and "old_logprob_seconds" not in b
        assert a["reward_mean"] == b["reward_mean"] and a["response_len"] == b["response_len"]
        for k in ("loss", "grad_norm", "entropy", "ratio", "mismatch/ratio_mean", "mismatch/weight_mean",
                  "logprob_mismatch_mean"):
            assert b[k] == pytest.approx(a[k], rel=5e-5, abs=1e-6), k


@pytest.mark.parametrize("overrides,key", [
    (["algorithm.updates_per_step=2"], "algorithm.updates_per_step"),
    (["algorithm.mismatch.tis_cap=2", "algorithm.mismatch.level=sequence"], "algorithm.mismatch.level"),
    (["algorithm.mismatch.reject=seq_max_k3", "algorithm.mismatch.reject_max=1"], "algorithm.mismatch.reject"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_in=reward"], "algorithm.kl_in"),
    (["loop.mode=async", "loop.stale=rescore"], "loop.stale"),
])
def test_what_current_cannot_serve_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.old_logprobs=current", *overrides])
    assert err.value.key == key and "recompute" in str(err.value)


def test_current_is_accepted_with_a_token_level_correction():
    cfg, _ = load_config(None, ["algorithm.old_logprobs=current", "algorithm.mismatch.tis_cap=2"])
    assert cfg.algorithm.old_logprobs == "current"
