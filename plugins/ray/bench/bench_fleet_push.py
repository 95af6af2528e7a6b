"""Weight pushes into two Ray rollout replicas on CPU: ``inproc`` through the fleet (buckets,
Ray's object store) against ``mapped`` (the writer's parameters lent by shared memory), same run
settings. Reports per push: seconds, and the writer rank's peak extra resident memory (all, and
private: without shared pages) from ``metrics.jsonl``. One simulated node, two data-parallel
ranks each colocated with a replica (the layout ``mapped`` needs).

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python plugins/ray/bench/bench_fleet_push.py [hidden] [layers]

(the malloc setting makes freed buffers leave the resident set at once, so RSS follows live memory)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    import ray
    from rlcore.stack import load_stack
    from rlcore.testing.runs import read_metrics
    from rlcore_ray.launch import train_on_ray

    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    model = (f"engine.model.tiny={{arch: qwen2, hidden_size: {hidden}, num_layers: {layers}, num_heads: 8, "
             f"num_kv_heads: 2, head_dim: 64}}")
    common = [model, "training.steps=6", "data.prompts_per_step=4", "rollout.n=4", "output.progress=false",
              "output.tensorboard=false", "output.plot=false", "output.checkpoint_every=0", "plugins=[ray]", "cluster.backend=ray",
              "cluster.trainer.dp=2", "cluster.rollout.replicas=2", "cluster.placement=colocated",
              "cluster.trainer.resources.num_cpus=0.5", "cluster.rollout.resources.num_cpus=0.5",
              "ray.strategy=STRICT_PACK", "cluster.timeout_s=600"]
    cases = {"inproc 4 MiB": ["sync.name=inproc", "sync.bucket_mb=4"],
             "inproc 32 MiB": ["sync.name=inproc", "sync.bucket_mb=32"],
             "mapped": ["sync.name=mapped"]}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for name, extra in cases.items():
            with tempfile.TemporaryDirectory() as d:
                train_on_ray(load_stack(str(ROOT / "examples" / "tiny.yaml"), [*common, *extra, f"output.dir={d}"]))
                rows = read_metrics(Path(d))[1:]  # the first push sets up (shares storages, opens them)
            results[name] = {
                "model_mib": rows[0]["sync_bytes"] / (1 << 20),
                "push_s_median": statistics.median(r["sync_seconds"] for r in rows),
                "peak_extra_rss_mib_max": max(r["push_peak_extra_rss_mib"] for r in rows),
                "peak_extra_private_mib_max": max(r["push_peak_extra_private_mib"] for r in rows),
                "levels": sorted({r["sync_level"] for r in rows}), "pushes": len(rows)}
            print(name, json.dumps(results[name]), flush=True)
    finally:
        ray.shutdown()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
