"""Tensor, expert, data and pipeline parallelism on CPU (gloo, ranks through torchrun) against a
world of one: log-probs, gradients, the gradient norm and the HF export must agree; data
parallelism beside tensor parallelism against tensor parallelism alone; pipeline stages (with
virtual stages, and beside TP) against one rank.

What megatron-core allows on CPU: dense TP=2 without sequence parallelism, and EP=2 with the
allgather dispatcher. MoE with TP>1 needs sequence parallelism, which megatron's local norm
rejects, so it is not checked here.

Tolerances: the parallel ranks compute the one-rank step up to float32 summation order (TP: the
row-parallel all-reduce and the vocab-parallel softmax; EP: the dispatcher's sum; DP: each
replica's gradient sum, then the all-reduce; PP: the same operations, the activations and their
gradients sent exactly), ~1e-7 relative, so log-probs and gradients (O(1)
and O(0.1)) agree within 1e-5. The weights after one AdamW step move by lr * g / (|g| + eps)
(lr = 1e-2, eps = 1e-8): a change d in g moves that by lr * eps * d / (|g| + eps)^2, so where
|g| >= 1e-5 the weights agree within 1e-6 (d is at most 1e-5, in fact ~1e-9); where 0 < |g| < 1e-5
the update is a ratio of noise and may differ by up to its full size, 2 * lr; where g = 0 (unused
vocabulary rows, unchosen experts) neither side moves beyond the noise's lr * 1e-12 / eps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.fixture(scope="module")
def one_rank(megatron_dirs, run_worker, tmp_path_factory):
    """``one_rank(model)``: the world-of-one result for a model directory, computed once."""
    cache: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in cache:
            cache[model] = run_worker(WORKER, megatron_dirs[model], tmp_path_factory.mktemp("one") / "one.pt",
                                      1, 1, world=1)
        return cache[model]

    return get


def _compare(par: dict, ref: dict) -> tuple[float, float, float]:
    lp = float((par["logprobs"] - ref["logprobs"]).abs().max())
    assert set(par["grads"]) == set(ref["grads"])
    grad = max(float((par["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"])
    step = torch.cat([(par["after"][k] - ref["after"][k]).abs().flatten() for k in ref["after"]])
    # g == 0 (unused vocabulary rows, experts no token chose): no update on either side
    settled = torch.cat([(ref["grads"][k].abs() >= 1e-5).flatten() | (ref["grads"][k] == 0).flatten()
                         for k in ref["after"]])
    assert lp < 1e-5
    assert grad < 1e-5
    assert abs(par["grad_norm"] - ref["grad_norm"]) < 1e-5 * ref["grad_norm"]
    assert set(par["before"]) == set(ref["before"])
    assert all(torch.equal(par["before"][k], ref["before"][k]) for k in ref["before"]), "gathered export is exact"
    assert float(step[settled].max()) < 1e-6 and float(step.max()) <= 2e-2
    assert float(settled.float().mean()) > 0.9, "the comparison covers most weights"
    return lp, grad, float(step[settled].max())


@pytest.mark.parametrize("model,tp,ep,world", [("dense_kv2", 2, 1, 2), ("moe_mtp", 1, 2, 2), ("dense_kv2", 1, 1, 2)],
                         ids=["tp2", "ep2", "dp2"])
def test_parallel_matches_a_single_rank(megatron_dirs, run_worker, one_rank, tmp_path, figures, model, tp, ep, world):
    par = run_worker(WORKER, megatron_dirs[model], tmp_path / "par.pt", tp, ep, world=world)
    one = one_rank(model)
    lp, grad, step = _compare(par, one)
    dp = world // (tp * ep)
    figures(f"TP={tp} EP={ep} DP={dp} vs 1 rank ({model}): max |d logprob|, max |d grad|, max |d weight| after "
            f"one step where |g| >= 1e-5, grad norms", f"{lp:.2e}, {grad:.2e}, {step:.2e}, {par['grad_norm']:.6f} vs {one['grad_norm']:.6f}")
    assert par["mode"] == one["mode"]
    assert par["layout"]["dp"] == dp
    if dp == 2:  # the replicas split the sequences (3 + 2), each over several micro-batches
        assert par["shares"] == [[0, 1, 2], [3, 4]], par["shares"]
        assert par["micro_batches"] > 1
    else:
        assert all(share == [0, 1, 2, 3, 4] for share in par["shares"]), par["shares"]


def test_data_parallel_beside_tensor_parallel_matches_tensor_parallel(megatron_dirs, run_worker, one_rank, tmp_path,
                                                                       figures, combinations_only_on_newest):
    """DP=2 x TP=2 (four gloo ranks): each TP pair runs its share of the sequences; against TP=2
    alone and against one rank."""
    combinations_only_on_newest("DP=2 x TP=2")
    model = megatron_dirs["dense_kv2"]
    both = run_worker(WORKER, model, tmp_path / "dp2tp2.pt", 2, 1, world=4)
    tp = run_worker(WORKER, model, tmp_path / "tp2.pt", 2, 1, world=2)
    assert both["layout"]["dp"] == 2 and both["layout"]["tp"] == 2
    # megatron's rank order: TP fastest, so ranks 0, 1 are replica 0 and ranks 2, 3 replica 1
    assert both["shares"] == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]], both["shares"]
    vs_tp = _compare(both, tp)
    vs_one = _compare(both, one_rank("dense_kv2"))
    figures("DP=2 x TP=2 vs TP=2 / vs 1 rank (dense_kv2): max |d logprob|, |d grad|, |d weight| after one step",
            f"{vs_tp[0]:.2e}, {vs_tp[1]:.2e}, {vs_tp[2]:.2e} / {vs_one[0]:.2e}, {vs_one[1]:.2e}, {vs_one[2]:.2e}")


@pytest.mark.parametrize("tp,pp,vpp,dp", [(1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1), (1, 2, 1, 2)],
                         ids=["pp2", "pp2-vpp2", "tp2-pp2", "dp2-pp2"])
def test_pipeline_stages_match_a_single_rank(megatron_dirs, run_worker, one_rank, tmp_path, figures, tp, pp, vpp, dp,
                                             combinations_only_on_newest):
    """Pipeline stages (two, with and without two virtual stages each; beside TP=2 or DP=2 on four
    ranks) against one rank: log-probs and gradients of every stage, the gradient norm, and the
    export gathered from every stage at rank 0 (its names and values exactly one rank's)."""
    if (tp, vpp, dp) != (1, 2, 1):  # PP=2 with virtual stages is the kind; the rest combine it
        combinations_only_on_newest(f"PP={pp} virtual stages {vpp} TP={tp} DP={dp}")
    model = megatron_dirs["dense_4l"]
    par = run_worker(WORKER, model, tmp_path / "pp.pt", tp, 1, tp * pp * dp, pp, vpp)
    lp, grad, step = _compare(par, one_rank("dense_4l"))
    assert (par["layout"]["pp"], par["layout"]["vpp"], par["layout"]["tp"], par["layout"]["dp"]) == (pp, vpp, tp, dp)
    # ranks: tensor-parallel fastest, then data-parallel, then the stage
    want = [[0, 1, 2, 3, 4]] * (tp * pp) if dp == 1 else [[0, 1, 2], [3, 4]] * pp
    assert par["shares"] == want, par["shares"]
    figures(f"PP={pp} (virtual stages {vpp}) TP={tp} DP={dp} vs 1 rank (dense_4l): max |d logprob|, |d grad|, |d weight| "
            f"after one step, grad norms", f"{lp:.2e}, {grad:.2e}, {step:.2e}, {par['grad_norm']:.6f} vs "
            f"{one_rank('dense_4l')['grad_norm']:.6f}")

