"""The naive head: full logits in fp32, then log_softmax. Correct, and O(T·V) memory."""

from __future__ import annotations

import torch

from rlcore.types import HeadInput, HeadOutput


class NaiveHead:
    def __init__(self, counter: dict | None = None):
        self.counter = counter if counter is not None else {"forward": 0}

    def __call__(self, inp: HeadInput) -> HeadOutput:
        if inp.vocab.group is not None:
            raise ValueError("example-naive does not support a vocab-sharded weight")
        self.counter["forward"] += 1
        T = inp.hidden.shape[0]
        mask = inp.loss_mask if inp.loss_mask is not None else torch.ones(T, dtype=torch.bool, device=inp.hidden.device)
        w = inp.weight[: inp.vocab.valid_rows]
        logits = inp.hidden.float() @ w.float().t()
        temp = inp.temperature
        if isinstance(temp, torch.Tensor) and temp.dim() > 0:
            logits = logits / temp.float()[:, None]
        else:
            logits = logits / float(temp)
        logp_all = torch.log_softmax(logits, dim=-1)
        labels = torch.where(mask, inp.labels, torch.zeros_like(inp.labels))
        logprobs = logp_all.gather(1, labels[:, None]).squeeze(1) * mask
        entropy = None
        if inp.compute_entropy:
            entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
        return HeadOutput(logprobs=logprobs, entropy=entropy)
