"""Routing replay under tensor parallelism 2 and expert parallelism 2 (gloo, 2 ranks through
torchrun), on megatron-core 0.12.1 (interception) and 0.16.1 (native ``RouterReplay``).

Each run records the native routes, perturbs every router (native routing changes), then replays
the recorded routes through rlcore-replay's Replayer (R3). Checked against a world of one with the
same weights: the experts used equal the recorded ones, the log-probs equal the single-rank forward
forced to those experts, and without replay both differ.

MoE with TP > 1 runs in eval mode (the old-log-prob pass): megatron-core refuses MoE + TP > 1
without sequence parallelism only while training, and sequence parallelism needs Transformer
Engine's norm, which is not installable here (see test_parallel.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

WORKER = Path(__file__).with_name("replay_parallel_worker.py")


@pytest.fixture(scope="module")
def single_rank(megatron_dirs, tmp_path_factory):
    """The world of one, in this process (as the other engine tests run it)."""
    sys.path.insert(0, str(WORKER.parent))
    from replay_parallel_worker import run

    out = tmp_path_factory.mktemp("replay-one") / "one.pt"
    run(str(megatron_dirs["moe_kv2"]), str(out), 1, 1)
    return torch.load(out)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_replay_under_parallelism_forces_the_recorded_experts(megatron_dirs, run_worker, single_rank, tmp_path, figures, tp, ep):
    par = run_worker(WORKER, megatron_dirs["moe_kv2"], tmp_path / "par.pt", tp, ep, world=tp * ep)
    one = single_rank
    assert par["world"] == 2 and one["world"] == 1
    assert torch.equal(par["recorded"], one["recorded"]), "both record the same native routes"
    # the perturbation changed native routing, on both
    assert not torch.equal(par["native"], par["recorded"]) and torch.equal(par["native"], one["native"])
    # replay: the experts used are exactly the recorded ones
    assert torch.equal(par["replayed"], par["recorded"])
    assert par["metrics"]["replay/coverage"] == 1.0 and par["metrics"]["replay/agreement"] < 1.0
    # log-probs equal the single-rank forward forced to the recorded experts (and the forced
    # forward on these ranks); without replay they differ
    replay_gap = float((par["lp_replayed"] - one["lp_forced"]).abs().max())
    native_gap = float((par["lp_native"] - one["lp_forced"]).abs().max())
    assert replay_gap < 1e-5
    assert torch.equal(par["lp_replayed"], par["lp_forced"])
    assert native_gap > 1e-2, "without replay the log-probs differ"
    figures(f"replay under TP={tp} EP={ep} ({par['mode']}) vs forced single rank: max |d logprob| replay, native",
            f"{replay_gap:.2e}, {native_gap:.3f}; native agreement {par['metrics']['replay/agreement']:.3f}")
