"""Pools the interleaved rounds of several bench_fused_loss.py runs: per (T, case, configuration)
the median, mean and range of the per-round ratios to floor4 (``x_floor4_rounds``). A method's
name can map to a different configuration in each run (the default head changed between runs),
so each run is given with its own mapping. Measures nothing itself; prints a table.

Usage: python3 pool_rounds.py RESULTS.json:method=label,method=label [RESULTS.json:...] ...
(methods not named are pooled under their own names; ``-`` as a label leaves a method out)
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main(argv: list[str]) -> int:
    pooled: dict[tuple, list[float]] = defaultdict(list)
    per_run: dict[tuple, list[str]] = defaultdict(list)
    for n, spec in enumerate(argv, 1):
        path, _, mapping = spec.partition(":")
        names = dict(p.split("=", 1) for p in mapping.split(",") if p)
        for run in json.load(open(path))["runs"]:
            for case, methods in run["cases"].items():
                for method, res in methods.items():
                    label = names.get(method, method)
                    if label == "-" or "x_floor4_rounds" not in res:
                        continue
                    key = (run["T"], case, label)
                    pooled[key] += res["x_floor4_rounds"]
                    per_run[key].append(f"run{n} {res['x_floor4']:.3f}")
    print(f"{'T':>6} {'case':<12} {'configuration':<34} {'rounds':>6} {'median':>7} {'mean':>6}  range          per run")
    for key in sorted(pooled):
        xs = pooled[key]
        print(f"{key[0]:>6} {key[1]:<12} {key[2]:<34} {len(xs):>6} {statistics.median(xs):>7.3f} {statistics.mean(xs):>6.3f}"
              f"  {min(xs):.3f}–{max(xs):.3f}  {', '.join(per_run[key])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
