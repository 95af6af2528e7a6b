"""The fused-loss path (``Cap.FUSED_LOSS``) under vocab sharding, in gloo processes: each rank
holds a slice of the LM head (the last one with padding rows), forms the loss and its gradients
with one exchange of softmax records per chunk, and must match the unsharded float64 reference
(loss, log-probs, entropy, its dW rows, and dX summed over the ranks by rlcore's collectives).

Lives in the package (not in the tests) because spawned workers import it by name; run by
``plugins/fused/tests`` (torch backend) and the Triton interpreter suite.
"""

from __future__ import annotations

import os
import tempfile

import torch


def _inputs(T: int, H: int = 24, vocab: int = 50, rows: int = 56, seed: int = 31):
    from rlcore.algorithms import TokenInputs

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g)
    w = torch.randn(rows, H, generator=g) * 0.6
    w[vocab:] = 3.0  # padding rows with large logits: wrong if they ever enter a softmax
    labels = torch.randint(0, vocab, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.3
    seq_index = torch.sort(torch.randint(0, 3, (T,), generator=g)).values
    old = torch.where(mask, -4.0 + 0.5 * torch.randn(T, generator=g), torch.zeros(T))
    token_mean = mask.float() / max(int(mask.sum()), 1)  # the token-mean aggregation's weights
    x = TokenInputs(old_logprobs=old, rollout_logprobs=old, advantages=torch.randn(T, generator=g), mask=mask,
                    weights=token_mean, correction=None,
                    ref_logprobs=torch.where(mask, old + 0.3 * torch.randn(T, generator=g), torch.zeros(T)),
                    seq_index=seq_index,
                    seq_tokens=torch.zeros(3).index_add_(0, seq_index, mask.float()).clamp_min(1.0))
    return h, w, labels, mask, x, vocab


def _worker(rank: int, world: int, init_file: str, backend: str, config: dict, sequence_parallel: bool) -> None:
    import torch.distributed as dist
    from rlcore.algorithms import PPOClip, TokenObjective
    from rlcore.testing.conformance import float64_head
    from rlcore.types import HeadInput, LossRequest, VocabShard

    from rlcore_fused.head import FusedHead
    from rlcore_fused.tuning import TritonConfig

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        objective = TokenObjective(PPOClip(0.2, 0.28, 3.0), kl_coef=0.1, kl_estimator="k3", entropy_coef=0.05)
        T = 40
        h, w, labels, mask, x, vocab = _inputs(T)
        per = w.shape[0] // world
        w_local = w[rank * per:(rank + 1) * per].clone().requires_grad_(True)
        h_full = h.clone().requires_grad_(True)
        h_in = h_full.chunk(world, dim=0)[rank] if sequence_parallel else h_full
        head = FusedHead(backend=backend, chunk_tokens=7, triton_config=TritonConfig(**config))
        out = head(HeadInput(hidden=h_in, weight=w_local, labels=labels, temperature=0.8, loss_mask=mask,
                             vocab=VocabShard(rank * per, (rank + 1) * per, vocab, group=dist.group.WORLD),
                             sequence_parallel=sequence_parallel, loss=LossRequest(objective, x)))
        out.loss.backward()
        h64 = h.double().requires_grad_(True)
        w64 = w.double().requires_grad_(True)
        x64 = type(x)(**{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                         for k, v in x.__dict__.items()})
        ref_lp, ref_ent = float64_head(h64, w64, labels, vocab, 0.8, mask)
        ref_loss = (objective.value(ref_lp, ref_ent, x64) * x64.weights).sum()
        ref_loss.backward()
        close = torch.testing.assert_close
        close(out.loss.double(), ref_loss.detach().double(), rtol=1e-5, atol=1e-6)
        close(out.logprobs.double(), ref_lp.detach(), rtol=0, atol=2e-5)
        close(out.entropy.double(), ref_ent.detach(), rtol=0, atol=2e-5)
        close(w_local.grad.double(), w64.grad[rank * per:(rank + 1) * per].double(), rtol=1e-4, atol=1e-6)
        padding = w_local.grad[max(0, vocab - rank * per):]  # this rank's padding rows (maybe none)
        assert padding.numel() == 0 or padding.abs().max() == 0
        got_h, ref_h = h_full.grad.double(), h64.grad.double()
        if sequence_parallel:  # each rank's gradient holds its own sequence slice
            got_h, ref_h = got_h.chunk(world, dim=0)[rank], ref_h.chunk(world, dim=0)[rank]
        close(got_h, ref_h, rtol=1e-4, atol=1e-6)
    finally:
        dist.destroy_process_group()


def run_fused_loss_tp_check(backend: str, world: int = 2, sequence_parallel: bool = False, **config) -> None:
    """Spawn ``world`` gloo processes that shard the vocab and compare with float64 (raises in
    the parent when a rank disagrees). ``config``: :class:`rlcore_fused.tuning.TritonConfig` fields."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "store"), backend, config, sequence_parallel),
                 nprocs=world, join=True)
