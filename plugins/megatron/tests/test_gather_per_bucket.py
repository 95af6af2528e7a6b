"""The gathered export makes one all-gather per bucket, not one per tensor (issue 32 item 3).

Two gloo ranks (TP=2 dense, EP=2 MoE with an MTP layer) export through the sync's bucket builder
with buckets of a quarter of the model's gathered bytes (gather_bytes = the bucket size), and again
with one collective per tensor (gather_bytes=1, the export as it was). The worker counts the
collectives by wrapping torch.distributed's gather functions (gather_per_bucket_worker.py):

* grouped, the push makes at least two and at most as many all-gathers as it fills buckets, and
  no per-tensor ``all_gather``; per tensor it makes one for every sharded tensor;
* no collective produces more than a bucket (or the one tensor larger than a bucket), and when a
  collective starts no earlier gather buffer is alive: about one bucket's gather at a time, never
  the whole model;
* both exports are the same bytes, and equal to the checkpoint the engine loaded (the fused QKV,
  gate/up and row-parallel pieces reordered exactly)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

WORKER = Path(__file__).with_name("gather_per_bucket_worker.py")


@pytest.mark.parametrize("model,tp,ep", [("dense_kv2", 2, 1), ("moe_mtp", 1, 2)], ids=["tp2", "ep2"])
def test_one_all_gather_per_bucket(megatron_dirs, run_worker, tmp_path, figures, model, tp, ep):
    from safetensors.torch import load_file

    res = run_worker(WORKER, megatron_dirs[model], tmp_path / "gather.pt", tp, ep, world=2)
    grouped, per_tensor = res["grouped"], res["per_tensor"]

    assert grouped["collectives"]["list"] == 0 and per_tensor["collectives"]["list"] == 0
    assert 2 <= grouped["collectives"]["into"] <= grouped["buckets"], (grouped["collectives"], grouped["buckets"])
    assert per_tensor["collectives"]["into"] >= res["sharded"] > grouped["collectives"]["into"]
    assert max(grouped["sizes"]) <= max(res["bucket_bytes"], res["largest_gather"])
    assert grouped["max_alive"] == 1, "an earlier group's gather buffer outlived it"

    assert list(grouped["export"]) == list(per_tensor["export"]), "same names in the same order"
    assert all(torch.equal(grouped["export"][n], t) for n, t in per_tensor["export"].items())
    checkpoint = load_file(str(Path(megatron_dirs[model]) / "model.safetensors"))
    assert set(grouped["export"]) <= set(checkpoint)
    assert all(torch.equal(t, checkpoint[n].to(t.dtype)) for n, t in grouped["export"].items())
    figures(f"gathered export {model} TP={tp} EP={ep}: all-gathers grouped / buckets / per tensor",
            f"{grouped['collectives']['into']} / {grouped['buckets']} / {per_tensor['collectives']['into']}")
