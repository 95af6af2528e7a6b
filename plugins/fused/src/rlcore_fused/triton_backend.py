"""The Triton backend: launches :mod:`rlcore_fused.triton_kernels` and does the gradient GEMMs.

Forward: one Triton kernel writes per-(vocab split, token) softmax records; the splits are merged
here (a few ops over ``[splits, N]``). Backward: the vocab is walked in chunks; per chunk a Triton
kernel recomputes the logits and writes ``∂L/∂(x·wᵀ)`` in the input dtype, then cuBLAS forms
``dW[chunk] = dzᵀ·X`` (one GEMM over all tokens: its fp32 accumulator covers the whole sum) and
``dX += dz·W[chunk]`` into an fp32 accumulator. Extra memory: the chunk buffer (``chunk_mib``)
plus the fp32 ``[N, H]`` accumulator.

Runs on CUDA GPUs, and on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``,
small shapes, for tests).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field

import torch
from rlcore.distributed import group_size

from rlcore_fused import triton_kernels as K
from rlcore_fused.loss_common import LossResult, ObjectiveFn, chunk_tokens_for
from rlcore_fused.softmax_stats import (
    LN2,
    LOG2E,
    NEG_BIG,
    empty_record,
    exchange_records,
    finalize,
    merge_records,
)
from rlcore_fused.tuning import (
    GPU_16BIT_BACKWARD,
    GPU_16BIT_FORWARD,
    GPU_16BIT_POINTERS,
    GPU_32BIT,
    INTERPRETER,
    LOSS_PIPELINES,
    TileConfig,
    TritonConfig,
    pick_split_tiles,
)


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_FP32_ADDMM: dict[str, bool] = {}


def _addmm_into_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and 16-bit ``a``, ``b``: cuBLAS accumulates into the fp32
    buffer itself (``out_dtype``), so no partial product is ever rounded to 16 bits."""
    if not a.is_cuda:
        acc.addmm_(a.float(), b.float())
        return
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    key = str(a.dtype)
    if key not in _FP32_ADDMM:
        _FP32_ADDMM[key] = _probe_fp32_addmm(a.device, a.dtype)
    if _FP32_ADDMM[key]:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b))


def _probe_fp32_addmm(device, dtype) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 48, device=device, generator=g).to(dtype)
    b = torch.randn(48, 32, device=device, generator=g).to(dtype)
    acc = torch.randn(64, 32, device=device, generator=g)
    want = acc.double() + a.double() @ b.double()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError) as exc:
        warnings.warn(
            f"rlcore-fused: this torch ({torch.__version__}) has no fp32-output addmm for {dtype} ({exc}); "
            "the hidden-state gradient is accumulated over vocab chunks from 16-bit partial products",
            RuntimeWarning, stacklevel=3,
        )
        return False
    err = float((acc.double() - want).abs().max())
    if err > 1e-2:
        raise RuntimeError(f"rlcore-fused: torch.addmm(out_dtype=float32, out=acc) gave a wrong result (max error {err})")
    return True


@contextlib.contextmanager
def _full_precision_reductions():
    """cuBLAS may otherwise split long reductions (dW sums over every token) and add the pieces
    in 16 bits; the fp32-accumulation promise covers those too."""
    m = torch.backends.cuda.matmul
    prev = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_bf16_reduced_precision_reduction = False
    m.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = prev


@dataclass
class TritonKernels:
    config: TritonConfig = field(default_factory=TritonConfig)
    name: str = "triton"
    #: the last launched compiled kernels (registers, spills) for benchmarks and diagnostics
    compiled: dict = field(default_factory=dict, repr=False)
    #: benchmarks: a list to receive ``(phase, CUDA event)`` marks from the fused-loss path
    phase_log: list | None = field(default=None, repr=False)
    _streams: dict = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------------- configuration ------

    def _check_device(self, x: torch.Tensor) -> None:
        if x.is_cuda:
            return
        if x.device.type == "cpu" and interpreter_enabled():
            return
        raise RuntimeError(
            f"rlcore-fused: the Triton backend runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); "
            f"got tensors on {x.device}. Use fused.backend=torch (or auto) for this device."
        )

    def _tiles(self, x: torch.Tensor, which: str, use_tma: bool) -> TileConfig:
        chosen = getattr(self.config, which)
        if chosen is not None:
            return chosen
        if not x.is_cuda:
            return INTERPRETER
        if x.dtype == torch.float32:
            return GPU_32BIT
        if not use_tma:
            return GPU_16BIT_POINTERS
        return GPU_16BIT_FORWARD if which == "forward" else GPU_16BIT_BACKWARD

    def _use_tma(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        alignable = all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
                        and t.data_ptr() % 16 == 0 for t in (x, w))
        if self.config.use_tma is None:
            return bool(x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and alignable)
        if self.config.use_tma and not alignable:
            raise RuntimeError(
                "rlcore-fused: use_tma=True needs 16-byte aligned rows for hidden and weight "
                f"(hidden size {x.shape[1]} × {x.element_size()} bytes); set use_tma to None or False"
            )
        return bool(self.config.use_tma)

    def _operands(self, x, w, tiles: TileConfig, use_tma: bool):
        if not use_tma:
            return x, w
        from triton.tools.tensor_descriptor import TensorDescriptor

        return (TensorDescriptor.from_tensor(x, [tiles.block_m, tiles.block_k]),
                TensorDescriptor.from_tensor(w, [tiles.block_n, tiles.block_k]))

    def _split_tiles(self, x: torch.Tensor, n: int, v: int, tiles: TileConfig) -> int:
        if self.config.split_tiles is not None:
            return max(1, int(self.config.split_tiles))
        if not x.is_cuda:
            return 8
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return pick_split_tiles(_cdiv(n, tiles.block_m), _cdiv(v, tiles.block_n), sms)

    @staticmethod
    def _precision(x: torch.Tensor) -> str:
        # fp32 operands get exact products (tf32 would cost ~1e-3 relative error)
        return "ieee" if x.dtype == torch.float32 else "tf32"

    @staticmethod
    def _dot_upcast(x: torch.Tensor) -> bool:
        # the interpreter (CPU tensors) cannot multiply bf16 operands: see triton_kernels._logits_tile
        return (not x.is_cuda) and x.dtype != torch.float32

    @staticmethod
    def _device_ctx(x: torch.Tensor):
        return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()

    def _check_dtypes(self, x, w):
        if x.dtype != w.dtype:
            raise RuntimeError(
                f"rlcore-fused: hidden ({x.dtype}) and weight ({w.dtype}) must have the same dtype for the Triton backend"
            )
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise RuntimeError(f"rlcore-fused: the Triton backend takes bf16, fp16 or fp32 inputs, not {x.dtype}")

    # ---------------------------------------------------------------------- forward ------

    def local_record(self, x: torch.Tensor, w_valid: torch.Tensor, labels_local: torch.Tensor,
                     inv_temp: torch.Tensor, compute_entropy: bool, compute_sum_sq: bool = False) -> torch.Tensor:
        self._check_device(x)
        self._check_dtypes(x, w_valid)
        n, h = x.shape
        v = w_valid.shape[0]
        planes = 5 if compute_sum_sq else 4
        if v == 0:
            return empty_record(n, x.device, planes)
        x = x.contiguous()
        w_valid = w_valid.contiguous()
        use_tma = self._use_tma(x, w_valid)
        tiles = self._tiles(x, "forward", use_tma)
        split = tiles.block_n * self._split_tiles(x, n, v, tiles)
        num_splits = _cdiv(v, split)
        scale = (inv_temp.float() * LOG2E).contiguous()
        labels32 = labels_local.to(torch.int32).contiguous()
        parts = torch.empty(planes, num_splits, n, dtype=torch.float32, device=x.device)
        xs, ws = self._operands(x, w_valid, tiles, use_tma)
        grid = (_cdiv(n, tiles.block_m) * num_splits,)
        with self._device_ctx(x):
            self.compiled["forward"] = K.forward_stats_kernel[grid](
                xs, ws, labels32, scale, parts,
                n, v, h, x.stride(0), w_valid.stride(0), num_splits, split,
                BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m,
                USE_TMA=use_tma, DOT_PRECISION=self._precision(x), DOT_UPCAST=self._dot_upcast(x), COMPUTE_ENTROPY=compute_entropy,
                COMPUTE_SUMSQ=compute_sum_sq, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            )
        rec = merge_records(parts.transpose(0, 1), base2=True)
        # back to natural units: z = z₂·ln2, and Σe^{z-m}(z-m) = ln2·Σ2^{z₂-m₂}(z₂-m₂)
        # (s and q need nothing: 2^{z₂-m₂} = e^{z-m})
        rec[0] *= LN2
        rec[2] *= LN2
        rec[3] = torch.where(rec[3] > NEG_BIG / 2, rec[3] * LN2, torch.full_like(rec[3], NEG_BIG))
        return rec

    # --------------------------------------------------------------------- backward ------

    def chunk_rows(self, n: int, v: int, itemsize: int, block_n: int) -> int:
        """Vocab rows per backward chunk: as many as ``chunk_mib`` allows, split evenly."""
        budget = max(1, int(float(self.config.chunk_mib) * 2**20))
        most = max(block_n, (budget // max(1, n * itemsize)) // block_n * block_n)
        chunks = _cdiv(v, most)
        return min(v, _cdiv(_cdiv(v, chunks), block_n) * block_n)

    def grads(self, x, w_valid, labels_local, inv_temp, lse, mean_logit, g_lp, g_ent, need_dx, need_dw):
        self._check_device(x)
        n, h = x.shape
        v = w_valid.shape[0]
        dx_acc = torch.zeros(n, h, dtype=torch.float32, device=x.device) if need_dx else None
        dw = torch.empty(w_valid.shape, dtype=w_valid.dtype, device=w_valid.device) if need_dw else None
        if v == 0 or n == 0 or (g_lp is None and g_ent is None):
            if dw is not None:
                dw.zero_()
            return (dx_acc.to(x.dtype) if need_dx else None), dw
        x = x.contiguous()
        w_valid = w_valid.contiguous()
        use_tma = self._use_tma(x, w_valid)
        tiles = self._tiles(x, "backward", use_tma)
        xs, ws = self._operands(x, w_valid, tiles, use_tma)
        scale = (inv_temp.float() * LOG2E).contiguous()
        lse2 = (lse * LOG2E).contiguous()
        mu2 = (mean_logit * LOG2E).contiguous()
        labels32 = labels_local.to(torch.int32).contiguous()
        g_lp_c = g_lp.float().contiguous() if g_lp is not None else scale  # unused placeholder pointer
        g_ent_c = g_ent.float().contiguous() if g_ent is not None else scale
        rows = self.chunk_rows(n, v, x.element_size(), tiles.block_n)
        # row stride padded to 16 bytes (TMA needs it); the GEMMs read the [n, rows] view
        pad = 16 // x.element_size()
        dz = torch.empty(n, _cdiv(rows, pad) * pad, dtype=x.dtype, device=x.device)[:, :rows]
        dz_dst = dz
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            dz_dst = TensorDescriptor.from_tensor(dz, [tiles.block_m, tiles.block_n])
        precision = self._precision(x)
        reductions = _full_precision_reductions() if x.is_cuda else contextlib.nullcontext()
        with self._device_ctx(x), reductions:
            for c0 in range(0, v, rows):
                c1 = min(c0 + rows, v)
                grid = (_cdiv(n, tiles.block_m) * _cdiv(c1 - c0, tiles.block_n),)
                self.compiled["backward"] = K.backward_dlogits_kernel[grid](
                    xs, ws, labels32, scale, lse2, mu2, g_lp_c, g_ent_c, dz_dst,
                    n, v, h, x.stride(0), w_valid.stride(0), dz.stride(0), c0, c1,
                    BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m,
                    USE_TMA=use_tma, DOT_PRECISION=precision, DOT_UPCAST=self._dot_upcast(x),
                    HAS_G_LP=g_lp is not None, HAS_G_ENT=g_ent is not None,
                    num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                )
                block = dz[:, : c1 - c0]
                if need_dw:
                    if x.is_cuda:
                        torch.mm(block.t(), x, out=dw[c0:c1])
                    else:
                        dw[c0:c1] = (block.t().float() @ x.float()).to(dw.dtype)
                if need_dx:
                    _addmm_into_fp32(dx_acc, block, w_valid[c0:c1])
        return (dx_acc.to(x.dtype) if need_dx else None), dw

    # ------------------------------------------------------------------- fused loss ------

    def scale_in_place(self, t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``t *= g`` for a contiguous ``t`` (CUDA, or CPU under the interpreter) and a 0-d ``g``
        on its device, with no host sync: the kernel does nothing when ``g`` is 1. Returns ``t``."""
        n = t.numel()
        if n == 0:
            return t
        block = 4096
        programs = 4 * torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 2
        with self._device_ctx(t):
            K.scale_unless_one_kernel[(max(1, min(_cdiv(n, block), programs)),)](
                t, g.detach().float().contiguous(), n, BLOCK=block, num_warps=4)
        return t

    def loss_grads(self, x: torch.Tensor, w_valid: torch.Tensor, labels_local: torch.Tensor, inv_temp: torch.Tensor,
                   group, objective: ObjectiveFn, shard_rows: int | None = None) -> LossResult:
        """The fused-loss path: three GEMMs per token chunk (see :mod:`rlcore_fused.loss_common`).

        Per chunk of ``c`` tokens (``loss_chunk_mib`` of fp32 logits): cuBLAS writes the fp32
        logits ``X_c·Wᵀ`` (its fp32 accumulator, never rounded to 16 bits); a Triton row kernel
        reads them once for the token's log-prob, entropy, ``lse`` and ``E_p[z]`` (or, under
        tensor parallelism, the record that one all-gather merges); the objective gives
        ``∂L/∂logp``, ``∂L/∂H`` per token; a second row kernel overwrites the logits in place with
        ``∂L/∂logits`` in the input dtype; cuBLAS forms ``dX_c = dl·W`` (one GEMM over the whole
        vocabulary: fp32 accumulation, one rounding) and ``dW += dlᵀ·X_c``.

        The row kernels run over the chunk's two halves, and on CUDA the objective of a half (a
        chain of small torch kernels) runs on a side stream while the main stream's row kernel
        works on the other half (``loss_overlap``), so it is off the critical path.

        ``shard_rows``: this rank's weight rows, padding included (equal on every rank), which
        sets the chunk size: every rank must form the same chunks, since each half-chunk is one
        exchange, also a rank whose valid rows are fewer (padding) or none."""
        self._check_device(x)
        self._check_dtypes(x, w_valid)
        n, h = x.shape
        v = w_valid.shape[0]
        dev = x.device
        x = x.contiguous()
        w_valid = w_valid.contiguous()
        dx = torch.empty(n, h, dtype=x.dtype, device=dev)
        # the first chunk's GEMM writes dW; with no rows or no tokens there is no chunk
        dw = torch.empty(w_valid.shape, dtype=w_valid.dtype, device=dev) if (v and n) else \
            torch.zeros(w_valid.shape, dtype=w_valid.dtype, device=dev)
        dw32 = torch.zeros(w_valid.shape, dtype=torch.float32, device=dev) \
            if (self.config.loss_dw_fp32 and v > 0) else None
        # per-token results, written by the row kernel (or the TP merge) and the objective
        per_token = torch.empty(7, n, dtype=torch.float32, device=dev)
        logp_all, ent_all, lse2_all, mu_all, value_all, g_lp_all, g_ent_all = per_token.unbind(0)
        labels32 = labels_local.to(torch.int32).contiguous()
        scale = (inv_temp.float() * LOG2E).contiguous()
        sharded = group_size(group) > 1
        vp = _cdiv(v, 8) * 8  # fp32 row stride: the 16-bit view's rows stay 16-byte aligned
        c = chunk_tokens_for(self.config.loss_chunk_mib, _cdiv(max(v, shard_rows or 0), 8) * 8, 4, most=max(n, 1))
        c = _cdiv(n, _cdiv(n, c)) if n else 1  # equal chunks: no small last chunk with inefficient GEMMs
        buf = torch.empty(c, vp, dtype=torch.float32, device=dev)
        aliased = x.dtype != torch.float32
        dl_buf = buf.view(x.dtype) if aliased else buf
        block = int(self.config.loss_block) if x.is_cuda else 256
        warps = int(self.config.loss_warps) if x.is_cuda else 1
        main = torch.cuda.current_stream(dev) if x.is_cuda else None
        side = self._side_stream(dev) if (x.is_cuda and self.config.loss_overlap) else None
        pipeline = self.config.loss_pipeline
        if pipeline not in LOSS_PIPELINES:
            raise ValueError(f"rlcore-fused: loss_pipeline must be one of {', '.join(LOSS_PIPELINES)}; got {pipeline!r}")
        mark = self._phase_marker(x)

        def objective_into(a: int, b: int):
            """The objective over rows [a, b) into the per-token buffers; on the side stream when
            there is one (returns the event the main stream waits on)."""
            def run():
                value, g_lp, g_ent = objective(a, b, logp_all[a:b], ent_all[a:b])
                value_all[a:b] = value
                g_lp_all[a:b] = g_lp
                g_ent_all[a:b] = g_ent
            if side is None:
                run()
                return None
            side.wait_stream(main)  # the row kernel's results for [a, b) are queued before this
            with torch.cuda.stream(side):
                run()
                return side.record_event()

        def logits_into(a: int, b: int, z: torch.Tensor):
            if x.is_cuda:
                torch.mm(x[a:b], w_valid.t(), out_dtype=torch.float32, out=z)
            else:
                z.copy_(x[a:b].float() @ w_valid.float().t())

        def dx_from(a: int, b: int, dl: torch.Tensor):
            if x.is_cuda:
                torch.mm(dl, w_valid, out=dx[a:b])
            else:
                dx[a:b] = (dl.float() @ w_valid.float()).to(dx.dtype)

        # "rows" splits only the row passes, and only where a side stream overlaps them (and on
        # CPU, where the tests exercise them); the "gemm" schedules always split (so that serial
        # and overlapped runs form the same GEMMs: bitwise equal results)
        split = side is not None or not x.is_cuda or pipeline != "rows"
        split_gemm = pipeline != "rows"
        split_dx = pipeline == "gemm+dx"
        reductions = _full_precision_reductions() if x.is_cuda else contextlib.nullcontext()
        with self._device_ctx(x), reductions:
            mark("setup")
            for lo in range(0, n, c):
                hi = min(lo + c, n)
                m = hi - lo
                xc = x[lo:hi]
                mid = lo + (m + 1) // 2
                halves = [(lo, mid), (mid, hi)] if m > 1 and split else [(lo, hi)]
                if v and not split_gemm:
                    logits_into(lo, hi, buf[:m, :v])
                    mark("gemm_logits")
                events = []
                for a, b in halves:
                    if v and split_gemm:  # v == 0: a rank holding only padding rows
                        logits_into(a, b, buf[a - lo:b - lo, :v])
                        mark("gemm_logits")
                    self._loss_row_stats(buf, a - lo, a, b, v, labels32, scale, logp_all, ent_all, lse2_all,
                                         mu_all, group if sharded else None, block, warps)
                    mark("row_stats")
                    events.append(objective_into(a, b))
                if v == 0:
                    continue
                for (a, b), ev in zip(halves, events, strict=True):
                    if ev is not None:
                        main.wait_event(ev)
                    K.loss_row_dlogits_kernel[(b - a,)](
                        buf[a - lo:], buf.stride(0), dl_buf[a - lo:], dl_buf.stride(0), labels32[a:b], scale[a:b],
                        lse2_all[a:b], mu_all[a:b], g_lp_all[a:b], g_ent_all[a:b], v,
                        BLOCK=block, ALIASED=aliased, num_warps=warps,
                    )
                    mark("wait+row_dlogits")
                    if split_dx:
                        dx_from(a, b, dl_buf[a - lo:b - lo, :v])
                        mark("gemm_dx")
                dl = dl_buf[:m, :v]
                if not split_dx:
                    dx_from(lo, hi, dl)
                    mark("gemm_dx")
                if dw32 is not None:
                    _addmm_into_fp32(dw32, dl.t(), xc)
                elif x.is_cuda:
                    if lo == 0:
                        torch.mm(dl.t(), xc, out=dw)
                    else:
                        dw.addmm_(dl.t(), xc)
                else:
                    prev = 0.0 if lo == 0 else dw.float()
                    dw.copy_((prev + dl.t().float() @ xc.float()).to(dw.dtype))
                mark("gemm_dw")
        if side is not None:
            main.wait_stream(side)  # the objective's last writes, before any buffer is reused
        if v == 0:
            dx.zero_()
        if dw32 is not None:
            dw.copy_(dw32)
        return LossResult(value_all.sum(), logp_all, ent_all, dx, dw)

    def _side_stream(self, dev: torch.device):
        """One side stream per device, kept (creating one per call costs host time)."""
        key = str(dev)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=dev)
        return self._streams[key]

    def _phase_marker(self, x: torch.Tensor):
        """``mark(label)``: with ``phase_log`` a list (benchmarks), records a CUDA event on the
        current stream labelled with the phase that just ended; otherwise does nothing."""
        log = self.phase_log
        if log is None or not x.is_cuda:
            return lambda label: None

        def mark(label: str):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            log.append((label, ev))
        return mark

    @staticmethod
    def _loss_row_stats(buf, row0, a, b, v, labels32, scale, logp_all, ent_all, lse2_all, mu_all, group, block, warps):
        """Rows [a, b) of the chunk (buffer rows from ``row0``): log-prob, entropy, lse₂ and μ into
        the per-token buffers; in-kernel when the vocabulary is whole, else through the record,
        its all-gather over ``group`` and the merge."""
        rows = b - a
        if v == 0:
            r = empty_record(rows, buf.device)
        elif group is None:
            K.loss_row_stats_kernel[(rows,)](
                buf[row0:], buf.stride(0), labels32[a:b], scale[a:b], logp_all[a:b], logp_all[a:b], ent_all[a:b],
                lse2_all[a:b], mu_all[a:b], rows, v, BLOCK=block, COMPUTE_ENTROPY=True, FINALIZE=True, num_warps=warps,
            )
            return
        else:
            r = torch.empty(4, rows, dtype=torch.float32, device=buf.device)
            K.loss_row_stats_kernel[(rows,)](
                buf[row0:], buf.stride(0), labels32[a:b], scale[a:b], r, r, r, r, r, rows, v,
                BLOCK=block, COMPUTE_ENTROPY=True, FINALIZE=False, num_warps=warps,
            )
            r[0] *= LN2  # base-2 → natural units, as in local_record
            r[2] *= LN2
            r[3] = torch.where(r[3] > NEG_BIG / 2, r[3] * LN2, torch.full_like(r[3], NEG_BIG))
        logp, ent, lse, mu, _ = finalize(exchange_records(r, group), True)
        logp_all[a:b] = logp
        ent_all[a:b] = ent
        lse2_all[a:b] = lse * LOG2E
        mu_all[a:b] = mu
