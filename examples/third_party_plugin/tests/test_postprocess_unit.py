"""Unit-testing a chain hook with rlcore's kit: a small PackedBatch, a MicroBatchContext per
micro-batch, a real ModelOutput from core's reference head, and the hook called through the
plugin manager as the trainer's train pass calls it (docs/writing-plugins.md shows this file)."""

import torch

import rlcore_example.plugin as plugin
from rlcore.batch import PackedBatch
from rlcore.types import (
    BuildContext,
    EngineOutput,
    HeadInput,
    HeadWeight,
    MicroBatchContext,
    ModelOutput,
    VocabShard,
)

VOCAB, HIDDEN = 11, 8


def length_penalties(pm, cfg, batch, hidden, weight, micro_batch_tokens):
    """The example plugin's ``length_penalty`` loss term of every micro-batch of ``batch``."""
    head = pm.select("forward_fn", "reference", key="forward.name").factory(BuildContext(config=cfg))
    vocab = VocabShard.full(VOCAB)
    mbs = batch.micro_batches(micro_batch_tokens)
    terms = []
    for i, mb in enumerate(mbs):
        h = hidden[mb.token_offset : mb.token_offset + mb.num_tokens]
        head_out = head(HeadInput(hidden=h, weight=weight, labels=mb.labels(), vocab=vocab, loss_mask=mb.loss_mask))
        ctx = MicroBatchContext(step=0, phase="train", index=i, count=len(mbs), batch=mb, config=cfg,
                                num_tokens_in_step=batch.num_loss_tokens)
        output = ModelOutput(engine=EngineOutput(hidden=h), head=head_out,
                             head_weight=HeadWeight(weight, vocab), forward_fn=head)
        ((name, result),) = pm.postprocess(ctx, output)  # (plugin name, PostprocessResult) per plugin
        assert name == "example"
        terms.append(result.loss_terms["length_penalty"])
    return terms


def test_length_penalty_is_split_across_micro_batches(rlcore_plugin_manager, register_plugin, rlcore_config):
    register_plugin(plugin, "example")  # unregistered when the test ends, passed or failed
    cfg = rlcore_config("example.length_penalty=0.5")  # validated; the plugin's section included
    # three sequences: prompt then response; the loss mask covers the positions predicting the response
    batch = PackedBatch.pack([[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 2, 3]], response_starts=[2, 1, 3])
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    hidden = torch.randn(batch.num_tokens, HIDDEN, generator=gen, requires_grad=True)

    (whole,) = length_penalties(rlcore_plugin_manager, cfg, batch, hidden, weight, micro_batch_tokens=64)
    split = length_penalties(rlcore_plugin_manager, cfg, batch, hidden, weight, micro_batch_tokens=5)
    assert len(split) == 3

    # the value: 0.5 * (probability of each response token) summed, over the step's loss tokens
    probs = torch.softmax(hidden.detach().double() @ weight.double().T, dim=-1)
    target = probs.gather(1, batch.labels()[:, None]).squeeze(1)[batch.loss_mask]
    torch.testing.assert_close(whole.double(), 0.5 * target.sum() / batch.num_loss_tokens)
    # the trainer adds each micro-batch's terms to that micro-batch's loss; their sum is the step's
    torch.testing.assert_close(sum(split), whole)
    sum(split).backward()
    assert hidden.grad[batch.loss_mask].abs().sum() > 0
    assert hidden.grad[~batch.loss_mask].abs().sum() == 0  # masked positions get no gradient
