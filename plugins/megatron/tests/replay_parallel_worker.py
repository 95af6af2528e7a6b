"""One rank of the replay-under-parallelism check (run by torchrun from
test_megatron_replay_parallel.py, or in a process of its own as the world of one).

It loads an HF MoE directory into the megatron engine with the given tensor/expert parallel sizes,
in eval mode (the old-log-prob pass: megatron refuses MoE + TP > 1 without sequence parallelism
only while training), and on rank 0 saves:

* ``recorded``: the routes of a native forward;
* after perturbing every router's weight (the same seeded noise on every rank: the router weight
  is replicated over TP and EP ranks) — ``native`` routes and log-probs;
* ``replayed`` routes and log-probs: rlcore-replay's Replayer (R3) driving the seam with
  ``recorded``;
* ``forced`` log-probs: a forward whose router callback returns ``recorded`` directly (no Replayer).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "plugins" / "replay" / "src"))  # rlcore-replay needs only torch + rlcore

SEQS = [[3, 4, 5, 13, 6, 9, 11], [7, 7, 13, 4], [10, 9, 8, 7, 6, 13, 2, 5, 4]]


def run(model_dir: str, result_path: str, tp: int, ep: int) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from rlcore.batch import PackedBatch
    from rlcore.heads import reference_logprobs
    from rlcore.types import HeadInput, MicroBatchContext, RouterDecision
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.settings import MegatronSettings
    from rlcore_megatron.testing import perturb_routers
    from rlcore_replay.replay import Replayer

    engine = MegatronEngine(HFSource.from_dir(model_dir),
                            MegatronSettings(tensor_parallel_size=tp, expert_parallel_size=ep))
    engine.train(False)
    batch = PackedBatch.pack(SEQS, [2, 1, 3])

    def logprobs(hidden):
        hw = engine.head()
        return reference_logprobs(HeadInput(hidden=hidden, weight=hw.weight, labels=batch.labels(), vocab=hw.vocab,
                                            loss_mask=batch.loss_mask)).logprobs.detach()

    with torch.no_grad():
        recorded = engine.forward(batch, record_routes=True).routes.clone()
        perturb_routers(engine, seed=1, scale=3.0)
        native = engine.forward(batch, record_routes=True)
        batch.fields["routes"] = recorded.to(torch.int16)
        cfg = OmegaConf.create({"replay": {"mode": "R3", "on_missing": "error", "mtp": "replay", "agreement": True}})
        rep = Replayer(cfg)
        ctx = MicroBatchContext(step=0, phase="old_logprob", index=0, count=1, batch=batch, config=cfg)
        rep.forward_request(ctx)
        replayed = engine.forward(batch, record_routes=True, router=rep.router_hook, micro_batch=ctx)
        rep.postprocess(ctx, SimpleNamespace(engine=replayed))
        metrics = rep.step_end(SimpleNamespace(step=0, batch=batch))
        forced = engine.forward(batch, router=lambda call: RouterDecision(
            indices=recorded[:, call.routed_index].long()))
        result = {"recorded": recorded, "native": native.routes, "replayed": replayed.routes,
                  "lp_native": logprobs(native.hidden), "lp_replayed": logprobs(replayed.hidden),
                  "lp_forced": logprobs(forced.hidden), "metrics": metrics,
                  "mode": engine.seam.mode, "world": dist.get_world_size() if dist.is_initialized() else 1}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, result_path)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
