"""One rank of a parallel check (run by torchrun from test_parallel.py, or in-process with a world
of one for the reference). It loads an HF directory into the megatron engine and runs one step
the way the trainer does, through rlcore's model-parallel rank strategy
(:class:`rlcore.parallel.model_parallel.ModelParallel`): this replica's micro-batches of the batch
(all of them with one data-parallel replica), per-token log-probs reduced over the replicas, a
fixed loss normalised by the whole batch's loss tokens, gradients reduced over the replicas, one
optimizer step. Rank 0 saves the log-probs, the gradient norm and the gradients, the HF export
before and after the step, and which sequences each rank ran. Arguments: the model directory,
the result file, tp, ep and optionally pp and virtual stages; the data-parallel size is implied:
world / (tp * ep * pp)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

#: five sequences of uneven lengths and a small token budget: several micro-batches, an uneven
#: split over two data-parallel replicas (3 + 2 sequences)
SEQS = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2], [5, 6, 7, 8], [2, 3, 13, 4, 4, 9]]
PROMPT_LENS = [1, 1, 2, 2, 1]
MICRO_BATCH_TOKENS = 12


def run(model_dir: str, result_path: str, tp: int, ep: int, pp: int = 1, vpp: int = 1) -> None:
    import torch.distributed as dist
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.parallel.model_parallel import ModelParallel
    from rlcore.ranks import TorchRanks
    from rlcore.types import HeadInput
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.pipeline import gather_stages
    from rlcore_megatron.settings import MegatronSettings
    from rlcore_megatron.weights import export_hf

    engine = MegatronEngine(HFSource.from_dir(model_dir),
                            MegatronSettings(tensor_parallel_size=tp, expert_parallel_size=ep,
                                             pipeline_parallel_size=pp, virtual_pipeline_stages=vpp))
    strategy = ModelParallel(TorchRanks(), splits_samples=True)
    strategy.built(engine, None)
    batch = PackedBatch.pack(SEQS, PROMPT_LENS)
    weights = torch.linspace(0.5, 1.5, batch.num_tokens)
    engine.setup_optimizer(SimpleNamespace(lr=1e-2, betas=[0.9, 0.99], weight_decay=0.0))
    before = {n: t.clone() for n, t in engine.export_hf_weights()}
    engine.train(True)
    engine.zero_grad()
    logprobs = torch.zeros(batch.num_tokens)
    mbs = strategy.micro_batches(batch, MICRO_BATCH_TOKENS)
    for mb in mbs:
        out = engine.forward(mb)
        hw = engine.head()
        lp = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=mb.labels(), vocab=hw.vocab,
                                          loss_mask=mb.loss_mask)).logprobs
        start = mb.token_offset - batch.token_offset
        logprobs[start: start + mb.num_tokens] = lp.detach()
        loss = -(lp * weights[start: start + mb.num_tokens]).sum() / batch.num_loss_tokens
        loss.backward()
    strategy.reduce_logprobs(logprobs)
    strategy.reduce_gradients(engine.parameters())
    norm = engine.optimizer_step(grad_clip=0.0)
    # the step corrected expert gradients for the EP replicas; the optimizer does not change .grad
    grad_stream = export_hf([(n, p.grad if p.grad is not None else torch.zeros_like(p))
                             for n, p in engine.named_parameters()], engine.names)
    if engine.pipe is not None:  # every stage's gradients to rank 0, as the weights' export does
        grad_stream = gather_stages(grad_stream, engine.pipe, engine.device)
    grads = {n: t.clone() for n, t in grad_stream}
    after = {n: t.clone() for n, t in engine.export_hf_weights()}
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, sorted({mb.seq_offset + i for mb in mbs for i in range(mb.num_seqs)}))
    if dist.get_rank() == 0:
        torch.save({"logprobs": logprobs, "grad_norm": norm, "grads": grads, "before": before, "after": after,
                    "mode": engine.seam.mode if engine.seam else None, "micro_batches": len(mbs), "shares": shares, "layout": engine.parallel_layout()}, result_path)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
