"""One rank of PPO's critic beside pipeline stages (torchrun from test_megatron_critic_pipeline.py,
or in-process with a world of one for the reference). It runs what the trainer runs for PPO, in
its order, through the trainer's own classes: the critic's value pass and GAE returns
(:meth:`rlcore.critic.Critic.advantage_input`), two critic updates on the clipped value loss
(:meth:`rlcore.critic.Critic.update`, several micro-batches each), then one policy pass (log-probs,
a fixed loss, backward, reduce and step through :class:`rlcore.parallel.model_parallel.ModelParallel`).
Rank 0 (the first stage, the trainer's writer) saves what it holds: the values, returns and
critic metrics, the critic's gradients of its last update (every stage's, gathered by name as the
export is, and the value head's from the last stage), the critic's values after its updates, and
the policy's log-probs, gradient norm and gradients. Arguments: the model directory, the result
file, tp, ep, pp, virtual stages."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

SEQS = [[3, 4, 5, 13, 6], [7, 7, 13], [10, 9, 8, 7, 6, 13, 2], [5, 6, 7, 8], [2, 3, 13, 4, 4, 9]]
PROMPT_LENS = [1, 1, 2, 2, 1]
REWARDS = [1.0, 0.0, 0.5, -0.5, 1.0]
MICRO_BATCH_TOKENS = 12


def _gathered_grads(engine) -> dict[str, torch.Tensor]:
    from rlcore_megatron.pipeline import gather_stages
    from rlcore_megatron.weights import export_hf

    stream = export_hf([(n, p.grad if p.grad is not None else torch.zeros_like(p))
                        for n, p in engine.named_parameters()], engine.names)
    if engine.pipe is not None:
        stream = gather_stages(stream, engine.pipe, engine.device)
    return {n: t.clone() for n, t in stream}


def run(model_dir: str, result_path: str, tp: int, ep: int, pp: int = 1, vpp: int = 1) -> None:
    import torch.distributed as dist
    from rlcore.algorithms import AdvantageInput
    from rlcore.batch import PackedBatch
    from rlcore.critic import RETURNS, VALUES, Critic
    from rlcore.heads import reference_logprobs
    from rlcore.parallel.model_parallel import ModelParallel
    from rlcore.ranks import TorchRanks
    from rlcore.types import HeadInput
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.settings import MegatronSettings

    policy = MegatronEngine(HFSource.from_dir(model_dir),
                            MegatronSettings(tensor_parallel_size=tp, expert_parallel_size=ep,
                                             pipeline_parallel_size=pp, virtual_pipeline_stages=vpp))
    strategy = ModelParallel(TorchRanks(), splits_samples=True)
    strategy.built(policy, None)
    training = SimpleNamespace(lr=1e-2, betas=[0.9, 0.99], weight_decay=0.0, grad_clip=1.0,
                               micro_batch_tokens=MICRO_BATCH_TOKENS, on_nonfinite="raise")
    algorithm = SimpleNamespace(gamma=1.0, lam=0.95, updates_per_step=2,
                                critic=SimpleNamespace(warmup_steps=0, grad_clip=-1.0, lr=0.0, cliprange_value=0.2))
    critic = Critic(policy.make_value_model(seed=0), algorithm, training)
    policy.setup_optimizer(training)

    batch = PackedBatch.pack(SEQS, PROMPT_LENS)
    counts = [int(c) for c in batch.seq_sum(batch.loss_mask.float())]
    token_rewards = [torch.zeros(n) for n in counts]
    for t, r in zip(token_rewards, REWARDS, strict=True):
        t[-1] = r
    inp = AdvantageInput(rewards=torch.tensor(REWARDS), groups=torch.zeros(len(SEQS), dtype=torch.long),
                         token_rewards=token_rewards, logprobs=[torch.zeros(n) for n in counts])
    inp = critic.advantage_input(batch, inp)
    values, returns, stats = batch.fields[VALUES].clone(), batch.fields[RETURNS].clone(), dict(critic._stats)
    metrics = critic.update(batch, step=0)
    critic_grads = _gathered_grads(critic.model.body)
    head = critic.model.head
    head_grad = torch.cat([head.weight.grad.flatten(), head.bias.grad]) if head is not None \
        else torch.zeros(policy.spec.hidden_size + 1)
    if policy.pipe is not None:  # the head is the last stage's: to every stage, rank 0 included
        dist.broadcast(head_grad, src=policy.pipe.rank_of(pp - 1), group=policy.pipe.group)
    critic_grads["value_head"] = head_grad
    critic.model.train(False)
    with torch.no_grad():
        after = critic.model.values(batch).detach()

    policy.train(True)
    policy.zero_grad()
    logprobs = torch.zeros(batch.num_tokens)
    weights = torch.linspace(0.5, 1.5, batch.num_tokens)
    for mb in strategy.micro_batches(batch, MICRO_BATCH_TOKENS):
        out = policy.forward(mb)
        hw = policy.head()
        lp = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=mb.labels(), vocab=hw.vocab,
                                          loss_mask=mb.loss_mask)).logprobs
        start = mb.token_offset - batch.token_offset
        logprobs[start: start + mb.num_tokens] = lp.detach()
        (-(lp * weights[start: start + mb.num_tokens]).sum() / batch.num_loss_tokens).backward()
    strategy.reduce_logprobs(logprobs)
    strategy.reduce_gradients(policy.parameters())
    policy_norm = policy.optimizer_step(grad_clip=0.0)
    policy_grads = _gathered_grads(policy)
    if dist.get_rank() == 0:
        mask = batch.loss_mask
        torch.save({"values": values[mask], "returns": returns[mask], "stats": stats, "metrics": metrics,
                    "critic_grads": critic_grads, "after": after[mask], "logprobs": logprobs[mask],
                    "policy_grad_norm": policy_norm, "policy_grads": policy_grads,
                    "advantage_values": torch.cat(list(inp.values))}, result_path)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
