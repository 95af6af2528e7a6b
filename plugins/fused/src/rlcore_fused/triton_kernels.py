"""The Triton kernels of the fused head. Imported only by :mod:`rlcore_fused.triton_backend`.

Two kernels, both tiled GEMMs ``X · W_validᵀ`` with fp32 accumulators whose logits never leave
registers:

* :func:`forward_stats_kernel` — grid (token block × vocab split). Each program walks its split
  tile by tile and keeps an online softmax per token in fp32: the running max ``m``,
  ``s = Σ e^{z-m}``, ``w = Σ e^{z-m}(z-m)`` (for the entropy), the target logit and, when
  asked, ``q = Σ e^{2(z-m)}`` (for ``Σπ² = Q/S²``). It writes one ``(m, s, w, z_target[, q])``
  record per (split, token); the host merges the splits.
* :func:`backward_dlogits_kernel` — grid (token block × vocab tile) over one vocab chunk. It
  recomputes the logits and writes ``dL/d(x·wᵀ)`` for the chunk (in the input dtype), which the
  host then multiplies with cuBLAS into ``dX`` (fp32 accumulation over chunks) and ``dW``.

Everything inside is in base-2 units (``z₂ = z·log₂e``) so that each exponential is one
``exp2``; the host converts the statistics back to natural units.

Operands arrive either as TMA tensor descriptors (Hopper and newer; out-of-bounds rows read as
zeros) or as plain pointers (older GPUs, rows not 16-byte aligned; out-of-range rows wrapped, the
hidden-size tail masked). ``USE_TMA`` picks the branch at compile time.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: a finite stand-in for -inf: exp2 of it underflows to 0, and 0·(it) is 0, not NaN
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Map a flat program id to (token block, vocab tile) so that GROUP_M consecutive token
    blocks walk the vocab together: their X rows and the W tiles they share stay in L2."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    return pid_m, pid_n


@triton.jit
def _logits_tile(x_src, w_src, row0, col0, N, V, H, stride_x, stride_w,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """fp32 ``X[row0:row0+BM] · W[col0:col0+BN]ᵀ``. Rows ≥ N and vocab rows ≥ V hold garbage
    (zeros under TMA, wrapped rows with pointers): callers mask them out.

    ``DOT_UPCAST`` converts 16-bit operands to fp32 before the dot. Only the Triton interpreter
    sets it: its ``dot`` multiplies bf16 operands as raw uint16 bit patterns. The products of
    bf16 values are exact in fp32, so this computes what the tensor cores compute on a GPU.
    """
    # The first K step is peeled so that the accumulator is first written by the MMA itself: a
    # zero-initialised accumulator makes ptxas serialise the wgmma pipeline (warning C7515).
    if USE_TMA:
        a = x_src.load([row0, 0])
        b = w_src.load([col0, 0])
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        for k in range(1, tl.cdiv(H, BK)):
            a = x_src.load([row0, k * BK])
            b = w_src.load([col0, k * BK])
            if DOT_UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
    else:
        # Out-of-range rows and vocab rows are wrapped onto valid ones instead of masked (fewer
        # live registers than masks); the callers never use those rows and columns.
        rows = (row0 + tl.arange(0, BM)) % N
        cols = (col0 + tl.arange(0, BN)) % V
        ks = tl.arange(0, BK)
        x_ptrs = x_src + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
        w_ptrs = w_src + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
        a = tl.load(x_ptrs, mask=ks[None, :] < H, other=0.0)
        b = tl.load(w_ptrs, mask=ks[None, :] < H, other=0.0)
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        for k in range(1, tl.cdiv(H, BK)):
            x_ptrs += BK
            w_ptrs += BK
            a = tl.load(x_ptrs, mask=ks[None, :] < H - k * BK, other=0.0)
            b = tl.load(w_ptrs, mask=ks[None, :] < H - k * BK, other=0.0)
            if DOT_UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def forward_stats_kernel(
    x_src, w_src, labels_ptr, scale_ptr, stats_ptr,
    N, V, H, stride_x, stride_w, num_splits, split_size,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr,
    COMPUTE_SUMSQ: tl.constexpr = False,
):
    """Per (token block, vocab split): online base-2 softmax statistics over the split.

    ``scale_ptr[n] = log2(e) / temperature[n]``; ``labels_ptr[n]`` is the target's row in this
    weight (any value when the target lives elsewhere). ``stats_ptr`` is ``[4, num_splits, N]``
    fp32: max, Σ2^{z-m}, Σ2^{z-m}(z-m), target logit (NEG_BIG when not in this split), all in
    base-2 units; with ``COMPUTE_SUMSQ`` a fifth plane ``Σ2^{2(z-m)}`` (the same number in
    natural units: ``2^{z₂-m₂} = e^{z-m}``), rescaled by ``α²`` as the max moves.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BM)
    pid_m, pid_s = _grouped_tile(pid, num_m, num_splits, GROUP_M)
    row0 = pid_m * BM
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < N
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
    label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)

    m_i = tl.full((BM,), NEG_BIG, dtype=tl.float32)
    s_i = tl.zeros((BM,), dtype=tl.float32)
    w_i = tl.zeros((BM,), dtype=tl.float32)
    q_i = tl.zeros((BM,), dtype=tl.float32)
    t_i = tl.full((BM,), NEG_BIG, dtype=tl.float32)
    col_begin = pid_s * split_size
    col_end = tl.minimum(col_begin + split_size, V)
    offs_n = tl.arange(0, BN)
    for col0 in range(col_begin, col_end, BN):
        acc = _logits_tile(x_src, w_src, row0, col0, N, V, H, stride_x, stride_w,
                           BM, BN, BK, USE_TMA, DOT_PRECISION, DOT_UPCAST)
        z = acc * scale[:, None]
        if col0 + BN > col_end:  # only the split's last tile has columns past its end
            z = tl.where((col0 + offs_n < col_end)[None, :], z, NEG_BIG)
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        alpha = tl.exp2(m_i - m_new)
        zs = z - m_new[:, None]
        e = tl.exp2(zs)
        if COMPUTE_ENTROPY:
            # rescale the old Σe(z-m) to the new max: e^{m-m'}(w + (m-m')·s)
            w_i = alpha * (w_i + (m_i - m_new) * s_i) + tl.sum(e * zs, axis=1)
        if COMPUTE_SUMSQ:
            q_i = alpha * alpha * q_i + tl.sum(e * e, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        m_i = m_new
        local = label - col0
        # about one tile in five holds a target of the block: skip the compare elsewhere
        if tl.sum(((local >= 0) & (local < BN) & (col0 + local < col_end)).to(tl.int32), axis=0) > 0:
            hit = offs_n[None, :] == local[:, None]
            t_i = tl.maximum(t_i, tl.max(tl.where(hit, z, NEG_BIG), axis=1))

    out = stats_ptr + pid_s * N + rows
    plane = num_splits * N
    tl.store(out, m_i, mask=row_ok)
    tl.store(out + plane, s_i, mask=row_ok)
    tl.store(out + 2 * plane, w_i, mask=row_ok)
    tl.store(out + 3 * plane, t_i, mask=row_ok)
    if COMPUTE_SUMSQ:
        tl.store(out + 4 * plane, q_i, mask=row_ok)


@triton.jit
def backward_dlogits_kernel(
    x_src, w_src, labels_ptr, scale_ptr, lse_ptr, mu_ptr, g_lp_ptr, g_ent_ptr, dz_dst,
    N, V, H, stride_x, stride_w, stride_dz, chunk_begin, chunk_end,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr,
):
    """``dz[n, v - chunk_begin] = ∂L/∂(x_n·w_v)`` for the vocab rows ``[chunk_begin, chunk_end)``
    (``dz_dst``: a pointer, or a TMA descriptor of block [BM, BN] when ``USE_TMA``).

    With p = softmax(z), z = x·wᵀ/τ: ∂logp/∂z = onehot − p and ∂H/∂z = −p(z − E_p[z]), so
    ``∂L/∂z = g_lp·onehot − p·(g_lp + g_ent·(z − μ))``, and ``∂L/∂(x·wᵀ) = (∂L/∂z)/τ``.
    ``lse_ptr`` and ``mu_ptr`` hold log Σ2^{z₂} and E_p[z₂] in base-2 units; ``scale_ptr`` is
    log₂e/τ as in the forward.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BM)
    num_n = tl.cdiv(chunk_end - chunk_begin, BN)
    pid_m, pid_n = _grouped_tile(pid, num_m, num_n, GROUP_M)
    row0 = pid_m * BM
    col0 = chunk_begin + pid_n * BN

    acc = _logits_tile(x_src, w_src, row0, col0, N, V, H, stride_x, stride_w,
                       BM, BN, BK, USE_TMA, DOT_PRECISION, DOT_UPCAST)

    # Per-row coefficients first, so that the epilogue is two FMAs, an exp2 and a select per
    # logit with only the accumulator live (z₂ = acc·s, s = log₂e/τ, 1/τ = s·ln2):
    #   ∂L/∂(x·wᵀ) = −2^{acc·s − lse₂} · (a + b·acc) + [v = target]·g_lp/τ
    #   a = (g_lp − g_ent·ln2·μ₂)/τ,   b = g_ent·ln2·s/τ
    rows = row0 + tl.arange(0, BM)
    cols = col0 + tl.arange(0, BN)
    row_ok = rows < N
    LN2: tl.constexpr = 0.6931471805599453
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    inv_t = scale * LN2
    a = tl.zeros((BM,), dtype=tl.float32)
    if HAS_G_LP:
        g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)
        a += g_lp * inv_t
    if HAS_G_ENT:
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
        a -= g_ent * LN2 * mu * inv_t
        b = g_ent * LN2 * scale * inv_t
        dz = -tl.exp2(acc * scale[:, None] - lse[:, None]) * (a[:, None] + b[:, None] * acc)
    else:
        dz = -tl.exp2(acc * scale[:, None] - lse[:, None]) * a[:, None]
    if HAS_G_LP:
        label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        dz = tl.where(cols[None, :] == label[:, None], dz + (g_lp * inv_t)[:, None], dz)
    if USE_TMA:
        # bulk asynchronous store; rows ≥ N are clipped by the descriptor. Columns past the chunk
        # end (last chunk only) land in buffer columns the gradient GEMMs do not read.
        dz_dst.store([row0, col0 - chunk_begin], dz.to(dz_dst.dtype))
    else:
        out = dz_dst + rows.to(tl.int64)[:, None] * stride_dz + (cols - chunk_begin)[None, :]
        tl.store(out, dz.to(dz_dst.dtype.element_ty), mask=row_ok[:, None] & (cols < chunk_end)[None, :])


# ---------------------------------------------------------------------------------------------
# The fused-loss path (Cap.FUSED_LOSS): row kernels over a chunk of fp32 logits that cuBLAS wrote
# ---------------------------------------------------------------------------------------------


@triton.jit
def loss_row_stats_kernel(
    z_ptr, stride_z, labels_ptr, scale_ptr, rec_ptr, logp_ptr, ent_ptr, lse2_ptr, mu_ptr, N, V,
    BLOCK: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr, FINALIZE: tl.constexpr,
):
    """One program per token row of ``z`` (fp32 logits ``x·wᵀ`` over this rank's ``V`` valid
    vocab rows): an elementwise online softmax per lane in base-2 units (``z₂ = z·scale``,
    ``scale = log₂e/τ``), merged across lanes at the end (no reduction inside the loop).

    ``FINALIZE`` (the whole vocabulary is in ``z``, no tensor-parallel merge): writes the token's
    log-prob and entropy (natural units), ``lse₂ = log₂ Σ2^{z₂}`` and ``μ = E_p[z/τ]`` (natural
    units) for the ∂L/∂logits kernel, so the host does no per-chunk arithmetic. Otherwise writes
    the row's softmax record ``(m, s, w, t)`` in base-2 units to ``rec_ptr`` ``[4, N]`` for the
    tensor-parallel merge."""
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    scale = tl.load(scale_ptr + row)
    m = tl.full((BLOCK,), NEG_BIG, dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    w = tl.zeros((BLOCK,), dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, V, BLOCK):
        cols = c0 + offs
        ok = cols < V
        z = tl.where(ok, tl.load(base + cols, mask=ok, other=0.0) * scale, NEG_BIG)
        m_new = tl.maximum(m, z)
        alpha = tl.exp2(m - m_new)
        zs = z - m_new
        e = tl.where(ok, tl.exp2(zs), 0.0)
        if COMPUTE_ENTROPY:
            w = alpha * (w + (m - m_new) * s) + e * zs
        s = alpha * s + e
        m = m_new
    big_m = tl.max(m, axis=0)
    present = s > 0
    delta = tl.where(present, m - big_m, 0.0)
    f = tl.where(present, tl.exp2(delta), 0.0)
    total_s = tl.sum(s * f, axis=0)
    total_w = tl.sum(f * (w + delta * s), axis=0)
    label = tl.load(labels_ptr + row)
    owned = (label >= 0) & (label < V)
    t = tl.load(base + tl.where(owned, label, 0).to(tl.int64)) * scale
    if FINALIZE:
        log_s = tl.log2(total_s)
        ratio = total_w / total_s
        # (t − m) first: the difference of two large logits is exact, then the small log S
        logp = tl.where(owned, (t - big_m - log_s) * LN2, NEG_BIG)
        tl.store(logp_ptr + row, logp)
        tl.store(ent_ptr + row, tl.maximum(log_s - ratio, 0.0) * LN2)
        tl.store(lse2_ptr + row, big_m + log_s)
        tl.store(mu_ptr + row, (big_m + ratio) * LN2)
    else:
        t = tl.where(owned, t, NEG_BIG)
        tl.store(rec_ptr + row, big_m)
        tl.store(rec_ptr + N + row, total_s)
        tl.store(rec_ptr + 2 * N + row, total_w)
        tl.store(rec_ptr + 3 * N + row, t)


@triton.jit
def loss_row_dlogits_kernel(
    z_ptr, stride_z, dl_ptr, stride_dl, labels_ptr, scale_ptr, lse2_ptr, mu_ptr, g_lp_ptr, g_ent_ptr, V,
    BLOCK: tl.constexpr, ALIASED: tl.constexpr,
):
    """One program per token row: ``dl[v] = ∂L/∂(x·w_v)`` from the row's fp32 logits ``z`` and
    the per-token loss derivatives ``g_lp = ∂L/∂logp``, ``g_ent = ∂L/∂H``:

        ∂L/∂z' = g_lp·(onehot − p) − g_ent·p·(z' − μ),   z' = z/τ,  ∂L/∂z = (∂L/∂z')/τ

    i.e. ``dl = −2^{z·s − lse₂}·(a + b·z) + [v = target]·g_lp/τ`` with ``a = (g_lp − g_ent·μ)/τ``,
    ``b = g_ent/τ²`` (``lse₂`` in base-2 units, ``μ = E_p[z']`` in natural units, ``s = log₂e/τ``).

    ``ALIASED``: ``dl`` is the 16-bit view of the same storage as ``z`` (row ``r``'s ``dl`` lives
    in the first half of row ``r``'s fp32 bytes). Tile ``k``'s stores then land on fp32 elements
    ``[k·B/2, (k+1)·B/2)``, which this program loaded at tiles ≤ k; the barrier before the store
    makes every warp finish tile ``k``'s loads (their values are consumed) before any warp
    overwrites them. Later tiles are never overwritten, so prefetching them is safe."""
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0)
    zrow = z_ptr + row.to(tl.int64) * stride_z
    drow = dl_ptr + row.to(tl.int64) * stride_dl
    scale = tl.load(scale_ptr + row)
    inv_t = scale * LN2
    lse2 = tl.load(lse2_ptr + row)
    mu = tl.load(mu_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    a = (g_lp - g_ent * mu) * inv_t
    b = g_ent * inv_t * inv_t
    hit_val = g_lp * inv_t
    label = tl.load(labels_ptr + row)
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, V, BLOCK):
        cols = c0 + offs
        ok = cols < V
        z = tl.load(zrow + cols, mask=ok, other=0.0)
        d = -tl.exp2(z * scale - lse2) * (a + b * z)
        d = tl.where(cols == label, d + hit_val, d)
        if ALIASED:
            tl.debug_barrier()
        tl.store(drow + cols, d.to(dl_ptr.dtype.element_ty), mask=ok)


@triton.jit
def scale_unless_one_kernel(t_ptr, g_ptr, N, BLOCK: tl.constexpr):
    """``t *= g`` in place (fp32 product, one rounding) unless the scalar ``g`` (device memory)
    is exactly 1: then every program returns after one load. Lets the fused loss's backward
    scale its stored gradients by the incoming gradient without a host sync (the usual incoming
    gradient is 1: ``loss.backward()`` on the step's loss). Grid-stride over ``N`` elements."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        offs = tl.arange(0, BLOCK)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, N, step):
            idx = start + offs
            ok = idx < N
            v = tl.load(t_ptr + idx, mask=ok)
            tl.store(t_ptr + idx, (v.to(tl.float32) * g).to(t_ptr.dtype.element_ty), mask=ok)
