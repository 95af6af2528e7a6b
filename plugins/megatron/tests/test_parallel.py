"""Tensor and expert parallelism on CPU (gloo, 2 ranks through torchrun) against a world of one:
log-probs, gradients, the gradient norm and the HF export must agree.

What megatron-core allows on CPU: dense TP=2 without sequence parallelism, and EP=2 with the
allgather dispatcher. MoE with TP>1 needs sequence parallelism, which megatron's local norm
rejects, so it is not checked here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.mark.parametrize("model,tp,ep", [("dense_kv2", 2, 1), ("moe_mtp", 1, 2)])
def test_parallel_matches_a_single_rank(megatron_dirs, run_worker, tmp_path, figures, model, tp, ep):
    par = run_worker(WORKER, megatron_dirs[model], tmp_path / "par.pt", tp, ep, world=2)
    one = run_worker(WORKER, megatron_dirs[model], tmp_path / "one.pt", 1, 1, world=1)
    lp = float((par["logprobs"] - one["logprobs"]).abs().max())
    grad = max(float((par["grads"][k] - one["grads"][k]).abs().max()) for k in one["grads"])
    figures(f"TP={tp} EP={ep} vs 1 rank ({model}): max |d logprob|, max |d grad|, grad norms",
            f"{lp:.2e}, {grad:.2e}, {par['grad_norm']:.6f} vs {one['grad_norm']:.6f}")
    assert lp < 1e-5
    assert set(par["grads"]) == set(one["grads"]) and grad < 1e-5
    assert abs(par["grad_norm"] - one["grad_norm"]) < 1e-5 * one["grad_norm"]
    assert set(par["before"]) == set(one["before"])
    assert all(torch.equal(par["before"][k], one["before"][k]) for k in one["before"]), "gathered export is exact"
    assert par["mode"] == one["mode"]
