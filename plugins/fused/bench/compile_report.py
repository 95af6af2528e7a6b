"""Compile the fused head's Triton kernels for a GPU target without a GPU and report what ptxas
says: registers, spills, shared memory, whether wgmma / mma instructions are used, and ptxas
performance warnings (C7515: wgmma serialised). Needs only a Triton install (it ships ptxas).

    python plugins/fused/bench/compile_report.py                 # the default tiles, sm_90a
    python plugins/fused/bench/compile_report.py --arch 80       # pointer-load path for sm_80

Do not set TRITON_INTERPRET for this script.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
from rlcore_fused import triton_kernels as K  # noqa: E402
from rlcore_fused.tuning import (  # noqa: E402
    GPU_16BIT_BACKWARD,
    GPU_16BIT_FORWARD,
    GPU_16BIT_POINTERS,
    GPU_32BIT,
    TileConfig,
)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def signature(kernel: str, dtype: str, t: TileConfig, tma: bool) -> dict:
    def desc(rows, cols):
        return f"tensordesc<{dtype}[{rows}, {cols}]>" if tma else f"*{dtype}"

    common = {"BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "GROUP_M": "constexpr",
              "USE_TMA": "constexpr", "DOT_PRECISION": "constexpr", "DOT_UPCAST": "constexpr"}
    if kernel == "forward":
        return {"x_src": desc(t.block_m, t.block_k), "w_src": desc(t.block_n, t.block_k), "labels_ptr": "*i32",
                "scale_ptr": "*fp32", "stats_ptr": "*fp32", "N": "i32", "V": "i32", "H": "i32", "stride_x": "i32",
                "stride_w": "i32", "num_splits": "i32", "split_size": "i32", **common, "COMPUTE_ENTROPY": "constexpr"}
    return {"x_src": desc(t.block_m, t.block_k), "w_src": desc(t.block_n, t.block_k), "labels_ptr": "*i32",
            "scale_ptr": "*fp32", "lse_ptr": "*fp32", "mu_ptr": "*fp32", "g_lp_ptr": "*fp32", "g_ent_ptr": "*fp32",
            "dz_dst": desc(t.block_m, t.block_n), "N": "i32", "V": "i32", "H": "i32", "stride_x": "i32",
            "stride_w": "i32", "stride_dz": "i32", "chunk_begin": "i32", "chunk_end": "i32", **common,
            "HAS_G_LP": "constexpr", "HAS_G_ENT": "constexpr"}


def report(kernel: str, dtype: str, tiles: TileConfig, tma: bool, arch: int) -> str:
    consts = {"BM": tiles.block_m, "BN": tiles.block_n, "BK": tiles.block_k, "GROUP_M": tiles.group_m,
              "USE_TMA": tma, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "DOT_UPCAST": False}
    if kernel == "forward":
        fn, consts["COMPUTE_ENTROPY"] = K.forward_stats_kernel, True
    else:
        fn, consts["HAS_G_LP"], consts["HAS_G_ENT"] = K.backward_dlogits_kernel, True, True
    src = ASTSource(fn=fn, signature=signature(kernel, dtype, tiles, tma), constexprs=consts)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    ptx = ck.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        arch_flag = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        out = subprocess.run([str(ptxas), f"-arch={arch_flag}", "-v", os.path.join(d, "k.ptx"), "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "none (FMA)")
    return (f"{kernel:8s} {dtype:5s} {tiles.block_m}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} "
            f"s{tiles.num_stages} {'tma' if tma else 'pointers':8s} sm_{arch}: regs {regs.group(1) if regs else '?'}, "
            f"spill stores {spills.group(1) if spills else '?'} B, smem {ck.metadata.shared} B, mma {mma}"
            + (", C7515 (wgmma serialised)" if "C7515" in out.stderr else ""))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this script compiles for a real GPU target")
    if args.arch >= 90:
        rows = [("forward", "bf16", GPU_16BIT_FORWARD, True), ("backward", "bf16", GPU_16BIT_BACKWARD, True),
                ("forward", "fp32", GPU_32BIT, True), ("backward", "fp32", GPU_32BIT, True)]
    else:
        rows = []
    rows += [("forward", "bf16", GPU_16BIT_POINTERS, False), ("backward", "bf16", GPU_16BIT_POINTERS, False)]
    for kernel, dtype, tiles, tma in rows:
        print(report(kernel, dtype, tiles, tma, args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
