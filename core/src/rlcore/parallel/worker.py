"""A trainer rank in its own process: joins torch.distributed and runs the trainer with the rank
strategy the engine's capabilities call for (:func:`rlcore.parallel.strategy.strategy_for`).

Used by the Ray actors (:mod:`rlcore.cluster.ray_launch`) and, without Ray, by anything that
starts the processes itself (the tests spawn two with ``torch.multiprocessing``).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from rlcore.parallel.strategy import RankStrategy
    from rlcore.ranks import Ranks

__all__ = ["config_yaml", "free_port", "init_distributed", "run_rank", "stack_from_yaml", "strategy_for"]

#: set in every process the cluster layer starts; ``rlcore train`` under another launcher
#: (torchrun) refuses to run (see :func:`refuse_foreign_launcher`)
LAUNCHED_ENV = "RLCORE_CLUSTER_RANK"


def stack_from_yaml(config_yaml: str) -> Any:
    """The stack of a resolved config shipped as YAML (the same plugins activate in this process)."""
    from rlcore.stack import load_stack

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config_yaml)
    try:
        return load_stack(f.name)
    finally:
        os.unlink(f.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_distributed(rank: int, world: int, master: str, device: str, timeout_s: float) -> str:
    """torch.distributed over TCP: gloo on CPU, NCCL on CUDA. Returns the backend."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "gloo"
    os.environ[LAUNCHED_ENV] = str(rank)
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return backend


def run_rank(config_yaml: str, rank: int, world: int, master: str, *, rollout: Any = None, resume: bool = False,
             overwrite: bool = False, allow_config_change: bool = False) -> dict[str, Any]:
    """Build the stack, join the group, train; the summary of the run (the writer's is the full one).
    The engine's declared capabilities decide the kind of ranks (:func:`strategy_for`):
    data parallel (``Cap.DATA_PARALLEL``: samples split, gradients summed) or model parallel
    (``Cap.TENSOR_PARALLEL`` / ``EXPERT_PARALLEL``: every rank the same samples, the engine's
    collectives)."""
    from rlcore.ranks import TorchRanks
    from rlcore.trainer import Trainer

    stack = stack_from_yaml(config_yaml)
    cfg = stack.config
    backend = init_distributed(rank, world, master, str(cfg.engine.device), float(cfg.cluster.timeout_s))
    failed = False
    trainer = None
    try:
        trainer = Trainer(stack, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                          strategy=strategy_for(stack, TorchRanks(), rollout))
        return trainer.run()
    except BaseException:
        failed = True
        # said before the teardown: under NCCL the other ranks' collectives can keep it waiting
        print(f"rlcore trainer rank {rank} of {world} failed:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        raise
    finally:
        # the trainer has closed its engine (megatron's groups); its modules still hold process groups,
        # which go now, before the default group, rather than at interpreter shutdown
        del trainer
        gc.collect()
        close_distributed(backend, failed)


#: the layout dimensions (``cluster.trainer.*``) that split the model rather than the samples
MODEL_DIMS = ("tp", "ep", "pp")


def strategy_for(stack: Any, ranks: Ranks, rollout: Any = None) -> RankStrategy:
    """The rank strategy of ``stack``'s engine on ``ranks``, by what the engine declares: one with
    :data:`Cap.TENSOR_PARALLEL`, :data:`Cap.EXPERT_PARALLEL` or :data:`Cap.PIPELINE_PARALLEL`
    runs its own shards, model parallel (and, declaring :data:`Cap.DATA_PARALLEL` too, splits the
    samples over its data-parallel replicas); one with :data:`Cap.DATA_PARALLEL` alone runs data
    parallel when the layout splits only the samples (``cluster.trainer``'s tp, ep and pp are 1).
    Any other engine is refused naming it."""
    from rlcore.errors import ConfigError
    from rlcore.parallel.data_parallel import DataParallel
    from rlcore.parallel.model_parallel import ModelParallel
    from rlcore.types import Cap

    caps = frozenset(stack.engine.capabilities)
    layout = OmegaConf.select(stack.config, "cluster.trainer", default=None)
    model_split = [d for d in MODEL_DIMS if layout is not None and int(layout.get(d, 1) or 1) > 1]
    model_caps = [Cap.TENSOR_PARALLEL, Cap.EXPERT_PARALLEL, Cap.PIPELINE_PARALLEL]
    if caps & set(model_caps):
        return ModelParallel(ranks, rollout, splits_samples=Cap.DATA_PARALLEL in caps)
    if Cap.DATA_PARALLEL in caps and not model_split:
        return DataParallel(ranks, rollout)
    wanted = model_caps if model_split else [Cap.DATA_PARALLEL, *model_caps]
    split = f" split by {', '.join(f'cluster.trainer.{d}' for d in model_split)}" if model_split else ""
    raise ConfigError(f"engine {stack.engine.name!r} ({stack.engine.distribution}) cannot run on {ranks.world} "
                      f"trainer ranks{split}: it declares none of the capabilities {', '.join(wanted)}",
                      key="engine.name")


def close_distributed(backend: str, failed: bool) -> None:
    """Leave the process group. A failed NCCL rank aborts its communicators instead: a graceful
    destroy waits for the collectives it left in flight, which the other ranks never complete
    (seen on two GPUs: the failing rank hung in ``destroy_process_group`` and its error was lost)."""
    import torch.distributed as dist

    if failed and backend == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            try:
                abort()
                return
            except Exception as exc:  # noqa: BLE001 - an experimental torch API; the destroy below still runs
                print(f"aborting the NCCL process group failed ({type(exc).__name__}: {exc}); destroying it",
                      file=sys.stderr)
    dist.destroy_process_group()


def config_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(cfg)


def refuse_foreign_launcher(cfg: Any) -> None:
    """``rlcore train`` started as one of several processes by another launcher (torchrun sets
    ``WORLD_SIZE``): every rank would write the same metrics and checkpoints and start its own
    rollout, so it is refused with the supported way."""
    from rlcore.errors import ConfigError

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and LAUNCHED_ENV not in os.environ:
        raise ConfigError(
            f"rlcore train was started as one of {world} processes (WORLD_SIZE={world}, e.g. by torchrun), which "
            f"is not supported: every rank would write the same outputs. Run one process with "
            f"cluster.backend=ray (cluster.trainer.dp=N; pip install 'rlcore[ray]'); see docs/scale.md",
            key="cluster.backend")
