"""Tuning knobs of the Triton backend, importable without Triton (the plugin's factory builds a
:class:`TritonConfig` from the ``fused:`` settings before any kernel is needed)."""

from __future__ import annotations

from dataclasses import dataclass

#: ``fused.backend`` values: checked at config time (plugin.py) and by the head
BACKENDS = ("auto", "triton", "torch")
#: ``TritonConfig.loss_pipeline`` values
LOSS_PIPELINES = ("rows", "gemm", "gemm+dx")


@dataclass(frozen=True)
class TileConfig:
    """One kernel's tiling: ``block_m`` tokens × ``block_n`` vocab rows per tile, ``block_k``
    of the hidden size per MMA step; ``group_m`` token blocks walk the vocab together (L2 reuse)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


@dataclass(frozen=True)
class TritonConfig:
    """Tuning knobs of the Triton backend; ``None`` fields are chosen per device and dtype."""

    forward: TileConfig | None = None
    backward: TileConfig | None = None
    #: vocab tiles per forward program (a program's split is ``split_tiles · block_n`` rows);
    #: None = the count that best fills the last wave of programs (see ``pick_split_tiles``)
    split_tiles: int | None = None
    #: size of the backward's ∂L/∂logits chunk buffer; sets how many vocab rows a chunk has
    chunk_mib: float = 512
    #: TMA tensor descriptors for the operands; None = on sm90+ when the strides allow it
    use_tma: bool | None = None
    #: fused-loss path (Cap.FUSED_LOSS): the fp32 logits chunk buffer; sets the tokens per chunk
    #: (at V=151936: 768 MiB is 1325 tokens); ∂L/∂logits is written over it in place
    loss_chunk_mib: float = 768
    #: fused-loss path: vocab entries per row-kernel step, and its warps
    loss_block: int = 2048
    loss_warps: int = 8
    #: fused-loss path: accumulate dW over token chunks in an fp32 buffer (4·V·H bytes more, e.g.
    #: 2.3 GiB at V=151936, H=4096) instead of adding each chunk's cuBLAS result into the 16-bit
    #: dW (one rounding per chunk)
    loss_dw_fp32: bool = False
    #: fused-loss path on CUDA: evaluate the objective of one half of a chunk on a side stream
    #: while the row kernel runs over the other half (False: everything on the current stream)
    loss_overlap: bool = True
    #: fused-loss path: how a chunk is split into halves. ``"rows"``: one logits GEMM per chunk,
    #: the two row passes per half (the side stream's objective of one half runs beside the row
    #: kernel of the other); ``"gemm"``: the logits GEMM per half too; ``"gemm+dx"``: the dX GEMM
    #: per half as well. cuBLAS's persistent GEMMs hold every SM, so nothing runs beside them and
    #: the split GEMMs bought nothing: on an H100 "rows" was fastest (docs/benchmarks/fused.md)
    loss_pipeline: str = "rows"
    #: fused-loss path on CUDA: run ``TokenObjective.closed_form`` through ``torch.compile``
    #: (a few fused kernels per chunk instead of a chain of ~35 small ones)
    loss_compile_objective: bool = True


# Hopper (TMA descriptors): 8 warps (two warpgroups), 3 stages (196 KB of shared memory with the
# peeled first K step); the forward's 256-token tiles stream the (large) weight half as often as
# 128-token ones, the backward keeps 128×256 (256×128 spills there). Compiled offline for sm_90a:
# wgmma, no spills. Timed against the alternatives by bench/bench_fused.py on an H100
# (docs/benchmarks/fused.md): 256×128 forward 31.2 ms vs 32.1 ms for 128×256 at T=16384.
GPU_16BIT_FORWARD = TileConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3)
GPU_16BIT_BACKWARD = TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3)
# masked pointer loads (pre-Hopper GPUs, or rows not 16-byte aligned): smaller K steps keep the
# 64-bit pointer tensors in registers (no spills on sm_80 or sm_90)
GPU_16BIT_POINTERS = TileConfig(128, 128, 32, group_m=8, num_warps=8, num_stages=3)
# fp32 operands: exact (ieee) FMA dots; tiles small enough not to spill
GPU_32BIT = TileConfig(64, 64, 16, group_m=8, num_warps=8, num_stages=3)
# the interpreter runs every program in Python: few, small tiles
INTERPRETER = TileConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)


def pick_split_tiles(token_blocks: int, vocab_tiles: int, processors: int, most: int = 16) -> int:
    """Vocab tiles per forward program. A program is one (token block, vocab split); the grid runs
    in waves of ``processors`` programs (one per SM: the tiles fill its shared memory), so the time
    goes as ``waves × tiles per program``. Pick the split size in [2, most] that minimises it (the
    larger on ties: fewer partial records to merge). At T=4096 on an H100 this is 144 tile-steps
    against 152 for a fixed 8."""
    best_key, best = None, most
    for tiles in range(2, most + 1):
        programs = token_blocks * -(-vocab_tiles // tiles)
        key = (-(-programs // processors) * tiles, -tiles)
        if best_key is None or key < best_key:
            best_key, best = key, tiles
    return best
