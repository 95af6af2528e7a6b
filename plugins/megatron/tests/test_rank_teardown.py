"""A run's processes end with no process group left (CPU, gloo): the trainer closes the megatron
engine (megatron-core's parallel state and the pipeline groups, then the default group if the
engine created it), the rank process destroys the default group it joined, and each process then
exits 0 through the interpreter's normal shutdown (no ``os._exit``). A group still held at
interpreter shutdown once ended a rank in SIGABRT after a successful run (the resumed run of
test_megatron_critic_pipeline.py in CI). A default group the user created before rlcore stays."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine("megatron")]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron_tiny.yaml"
ONE_STEP = ["training.steps=1", "data.prompts_per_step=2", "rollout.n=2", "output.progress=false",
            "output.tensorboard=false", "output.plot=false"]


def _groups_left() -> dict[str, object]:
    """What this process still holds: the default group, megatron's parallel state, pipeline groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from rlcore_megatron import pipeline

    return {"default group": dist.is_initialized(), "megatron parallel state": ps.model_parallel_is_initialized(),
            "pipeline groups": len(pipeline._GROUPS)}


def _pipeline_rank(rank: int, world: int, port: int, out: str, reports: object) -> None:
    from rlcore.parallel.worker import config_yaml, run_rank
    from rlcore.stack import load_stack

    stack = load_stack(str(EXAMPLE), ONE_STEP + ["megatron.pipeline_parallel_size=2", f"output.dir={out}"])
    run_rank(config_yaml(stack.config), rank, world, f"127.0.0.1:{port}")
    reports.put((rank, _groups_left()))  # type: ignore[attr-defined]
    # returns: the process ends through the interpreter's own shutdown


def _one_process(out: str, reports: object) -> None:
    """Two one-process runs (the ``local`` launcher's Trainer): one where the engine creates the
    world of one, then one inside a default group the user created first."""
    import torch.distributed as dist
    from rlcore.stack import load_stack
    from rlcore.testing.runs import Trainer

    Trainer(load_stack(str(EXAMPLE), ONE_STEP + [f"output.dir={out}/own"])).run()
    reports.put(("engine's world", _groups_left()))  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    Trainer(load_stack(str(EXAMPLE), ONE_STEP + [f"output.dir={out}/user"])).run()
    reports.put(("user's world", _groups_left()))  # type: ignore[attr-defined]
    dist.destroy_process_group()  # the user's own


def _spawn(target, argss: list[tuple]) -> tuple[list[int | None], dict]:
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, reports)) for args in argss]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
            p.join()
    got = {}
    while True:
        try:
            key, left = reports.get(timeout=1)
        except queue.Empty:
            break
        got[key] = left
    return [p.exitcode for p in procs], got


NOTHING_LEFT = {"default group": False, "megatron parallel state": False, "pipeline groups": 0}


def test_pipeline_ranks_release_every_group_and_exit_normally(tmp_path):
    """Two ranks (PP=2, ``run_rank`` as the Ray actors run it): after the run each holds no group,
    and both exit 0 without ``os._exit``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codes, left = _spawn(_pipeline_rank, [(r, 2, port, str(tmp_path)) for r in range(2)])
    assert codes == [0, 0], (codes, left)
    assert left == {0: NOTHING_LEFT, 1: NOTHING_LEFT}
    assert (tmp_path / "model").is_dir(), "the run trained and exported"


def test_one_process_run_releases_its_own_world_not_the_users(tmp_path):
    codes, left = _spawn(_one_process, [(str(tmp_path),)])
    assert codes == [0], (codes, left)
    assert left["engine's world"] == NOTHING_LEFT
    assert left["user's world"] == dict(NOTHING_LEFT, **{"default group": True})
