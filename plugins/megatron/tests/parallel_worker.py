"""One rank of a tensor/expert-parallel check (run by torchrun from test_parallel.py, or in-process
with a world of one for the reference). It loads an HF directory into the megatron engine,
computes per-token log-probs, takes one optimizer step on a fixed loss, and (rank 0) saves the
log-probs, the gradient norm, and the HF export before and after the step."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch


def run(model_dir: str, result_path: str, tp: int, ep: int) -> None:
    import torch.distributed as dist
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.types import HeadInput
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.settings import MegatronSettings
    from rlcore_megatron.weights import export_hf

    engine = MegatronEngine(HFSource.from_dir(model_dir),
                            MegatronSettings(tensor_parallel_size=tp, expert_parallel_size=ep))
    seqs = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2]]
    batch = PackedBatch.pack(seqs, [1, 1, 2])
    engine.setup_optimizer(SimpleNamespace(lr=1e-2, betas=[0.9, 0.99], weight_decay=0.0))
    before = {n: t.clone() for n, t in engine.export_hf_weights()}
    engine.train(True)
    engine.zero_grad()
    out = engine.forward(batch)
    hw = engine.head()
    lp = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels(), vocab=hw.vocab,
                                      loss_mask=batch.loss_mask)).logprobs
    loss = -(lp * torch.linspace(0.5, 1.5, lp.numel())).sum() / batch.num_loss_tokens
    loss.backward()
    norm = engine.optimizer_step(grad_clip=0.0)
    # the step corrected expert gradients for the EP replicas; the optimizer does not change .grad
    grads = {n: t.clone() for n, t in export_hf(
        [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in engine.named_parameters()], engine.names)}
    after = {n: t.clone() for n, t in engine.export_hf_weights()}
    if dist.get_rank() == 0:
        torch.save({"logprobs": lp.detach(), "grad_norm": norm, "grads": grads, "before": before, "after": after,
                    "mode": engine.seam.mode if engine.seam else None}, result_path)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
