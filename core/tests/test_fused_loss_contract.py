"""Core's side of Cap.FUSED_LOSS: a head that declares it gets the per-token objective in the train
phase (never for a sequence-level loss) and returns the loss with its gradients; the trainer's
result is the same as with the plain path. The head here implements the contract in plain torch
(reference log-probs, the closed form, a surrogate whose gradient is exactly Σ d_logp·∇logp +
d_H·∇H), so these tests check core's plumbing; plugins/fused/tests checks the fused kernels."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from rlcore.algorithms import objective as objmod
from rlcore.algorithms.losses import PPOClip, TokenObjective
from rlcore.heads import reference_logprobs
from rlcore.types import Cap, HeadInput, HeadOutput, LossRequest

ROOT = Path(__file__).resolve().parents[2]
#: a sequence-level loss (one that needs the sequence's log-ratio first, as rlcore-algorithms' GSPO):
#: core's plumbing is all these tests check
SEQUENCE_LEVEL = dataclasses.replace(PPOClip(), sequence_level=True)


class ClosedFormHead:
    """A Cap.FUSED_LOSS head in plain torch; records what core sent it."""

    def __init__(self):
        self.requests: list[LossRequest | None] = []

    def __call__(self, inp: HeadInput) -> HeadOutput:
        self.requests.append(inp.loss)
        out = reference_logprobs(inp)
        if inp.loss is None:
            return out
        assert not inp.loss.objective.loss.sequence_level, "core sent a sequence-level loss"
        lp, ent = out.logprobs, out.entropy
        x = inp.loss.inputs_for(inp.loss.inputs, lp)  # algorithm.old_logprobs current: the ratio's denominator
        tl = inp.loss.objective.closed_form(lp.detach(), ent.detach(), x)
        surrogate = (tl.d_logprobs * lp).sum() + (tl.d_entropy * ent).sum()
        loss = tl.value.sum() + surrogate - surrogate.detach()
        return HeadOutput(logprobs=lp.detach(), entropy=ent.detach(), loss=loss)


def _run(tmp_path: Path, overrides: list[str], head=None):
    from rlcore.run_output import read_metrics
    from rlcore.stack import load_config, resolve
    from rlcore.trainer import Trainer

    cfg, pm = load_config(ROOT / "examples" / "tiny.yaml",
                          [*overrides, f"output.dir={tmp_path}", "output.plot=false", "output.tensorboard=false",
                           "output.progress=false", "output.checkpoint_every=0", "training.steps=2"])
    stack = resolve(cfg, pm)
    if head is not None:
        spec = dataclasses.replace(stack.forward_fn, factory=lambda ctx: head,
                                   capabilities=stack.forward_fn.capabilities | {Cap.FUSED_LOSS})
        stack = dataclasses.replace(stack, forward_fn=spec)
    Trainer(stack).run()
    return read_metrics(tmp_path)


KEYS = ("loss", "grad_norm", "clipfrac", "entropy", "ratio")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["algorithm.entropy_coef=0.01", "algorithm.updates_per_step=2"],
    ["algorithm.loss_agg=seq-mean-token-mean", "algorithm.kl_coef=0.05", "training.micro_batch_tokens=40"],
    ["algorithm.old_logprobs=current", "algorithm.mismatch.tis_cap=1.02", "algorithm.mismatch.mask_low=0.98",
     "training.micro_batch_tokens=40"],
])
def test_trainer_result_is_the_same_with_a_fused_loss_head(tmp_path, overrides):
    plain = _run(tmp_path / "plain", overrides)
    head = ClosedFormHead()
    fused = _run(tmp_path / "fused", overrides, head)
    sent = [r for r in head.requests if r is not None]
    assert sent, "core never sent the loss request"
    current = "algorithm.old_logprobs=current" in overrides
    assert all(r.complete is not None for r in sent) if current else all(r.complete is None for r in sent)
    assert current or any(r is None for r in head.requests)  # the no-grad passes get none
    for a, b in zip(plain, fused, strict=True):
        for k in KEYS:
            if a.get(k) is not None:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


@pytest.mark.slow
def test_sequence_level_loss_keeps_the_plain_path(tmp_path):
    pytest.importorskip("rlcore_algorithms", reason="GSPO, the sequence-level loss run here, is rlcore-algorithms'")
    head = ClosedFormHead()
    rows = _run(tmp_path, ["plugins=[algorithms]", "algorithm.name=gspo"], head)
    assert all(r is None for r in head.requests)
    assert rows[-1]["grad_norm"] > 0


def test_loss_request_declines_sequence_level_losses():
    assert objmod.loss_request(None, TokenObjective(SEQUENCE_LEVEL), 1.0, objmod.ROLLOUT) is None


def test_inputs_at_slices_every_per_token_field():
    from rlcore.algorithms.spec import TokenInputs

    T = 6
    x = TokenInputs(old_logprobs=torch.arange(T) * 1.0, rollout_logprobs=torch.arange(T) * 2.0,
                    advantages=torch.arange(T) * 3.0, mask=torch.arange(T) % 2 == 0, weights=torch.arange(T) * 4.0,
                    correction=None, ref_logprobs=torch.arange(T) * 5.0, seq_index=torch.arange(T) // 3,
                    seq_tokens=torch.ones(2))
    req = LossRequest(TokenObjective(PPOClip()), x)
    sub = req.inputs_at(torch.tensor([4, 1]))
    assert sub.old_logprobs.tolist() == [4.0, 1.0] and sub.weights.tolist() == [16.0, 4.0]
    assert sub.mask.tolist() == [True, False] and sub.correction is None
    assert sub.ref_logprobs.tolist() == [20.0, 5.0] and sub.seq_index.tolist() == [1, 0]
    assert sub.seq_tokens is x.seq_tokens


def test_micro_batch_loss_takes_the_heads_loss():
    """head_loss replaces the plain loss; a sequence-level objective with a head loss is refused."""
    from rlcore.batch import PackedBatch  # noqa: F401 - the fields below are what token_inputs reads

    class MB:
        loss_mask = torch.tensor([True, True, False])
        fields = {"old_logprobs": torch.zeros(3), "advantages": torch.ones(3), "agg_numerator": torch.tensor([1.0, 1.0, 0.0])}

        def seq_index(self):
            return torch.zeros(3, dtype=torch.long)

        def seq_sum(self, v):
            return v.sum()[None]

    lp = torch.tensor([-1.0, -2.0, 0.0])
    given = torch.tensor(3.25, requires_grad=True)
    loss, stats = objmod.micro_batch_loss(MB(), lp, None, TokenObjective(PPOClip()), 2.0, "old_logprobs", head_loss=given)
    assert loss is given and stats["_tokens"] == 2.0
    with pytest.raises(RuntimeError, match="sequence-level"):
        objmod.micro_batch_loss(MB(), lp, None, TokenObjective(SEQUENCE_LEVEL), 2.0, "old_logprobs", head_loss=given)
