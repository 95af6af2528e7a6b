"""One rank of the critic's tensor/expert-parallel check (torchrun from test_megatron_critic.py,
or in-process with a world of one for the reference): the megatron value model's values, one
optimizer step on the clipped value loss, its gradients (HF names, gathered) and gradient norm."""

from __future__ import annotations

import sys

import torch


def run(model_dir: str, result_path: str, tp: int, ep: int) -> None:
    import torch.distributed as dist
    from rlcore.algorithms.gae import clipped_value_loss
    from rlcore.batch import PackedBatch
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.settings import MegatronSettings
    from rlcore_megatron.weights import export_hf

    policy = MegatronEngine(HFSource.from_dir(model_dir), MegatronSettings(tensor_parallel_size=tp,
                                                                           expert_parallel_size=ep))
    critic = policy.make_value_model(seed=0)
    critic.setup_optimizer(1e-2, (0.9, 0.99), 0.0)
    seqs = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2]]
    batch = PackedBatch.pack(seqs, [1, 1, 2])
    mask = batch.loss_mask.float()
    critic.train(True)
    critic.zero_grad()
    values = critic.values(batch)
    old = values.detach() + 0.3 * torch.sin(torch.arange(values.numel(), dtype=torch.float32))
    returns = torch.linspace(-1.0, 1.0, values.numel())
    per_token, _ = clipped_value_loss(values, old, returns, 0.2)
    ((per_token * mask).sum() / mask.sum()).backward()
    norm = critic.optimizer_step(grad_clip=0.0)
    grads = {n: t.clone() for n, t in export_hf(
        [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in critic.body.named_parameters()],
        critic.body.names)}
    grads["value_head.weight"] = critic.head.weight.grad.clone()
    after = critic.values(batch).detach()
    if dist.get_rank() == 0:
        torch.save({"values": values.detach(), "after": after, "grad_norm": norm, "grads": grads}, result_path)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
