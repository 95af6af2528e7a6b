"""The options of :func:`rlcore.sync.iter_buckets` that fill fixed buffers: ``group_by_dtype=False``
(one open bucket at a time, each tensor at an offset aligned to its item size) and
``defer_copies`` (a bucket's tensors copied in one fused launch when it is emitted), checked
against the plain per-tensor copies."""

from __future__ import annotations

import torch
from rlcore.sync import iter_buckets

KiB = 1024


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(300, 64, generator=g)),                 # 75 KiB: a bucket of its own
        *[(f"model.layers.{i}.mlp.experts.{e}.down_proj.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16))
          for i in range(3) for e in range(8)],
        ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=g)),
        ("model.step_counter", torch.arange(5, dtype=torch.int64) + seed),
        ("model.norm.weight", torch.randn(7, generator=g).to(torch.float16)),             # odd sizes: alignment
    ]


def test_iter_buckets_ungrouped_keeps_one_buffer_open_and_aligned():
    live = []

    def alloc(n, device):
        live.append(n)
        return torch.empty(n, dtype=torch.uint8)

    seen = []
    for b in iter_buckets(iter(_weights(4)), 16 * KiB, group_by_dtype=False, allocator=alloc):
        assert len(live) == len(seen) + 1, "one buffer is filled at a time"
        seen.append(b)
        for m in b.metas:
            assert m.offset % (m.nbytes // max(m.numel, 1) or 1) == 0
    got = {n: t for b in seen for n, t in b.tensors()}
    assert all(torch.equal(got[n], t) for n, t in _weights(4))
    assert {b.buffer.numel() <= 16 * KiB for b in seen[1:]} == {True}


def test_iter_buckets_deferred_fused_copies_match_per_tensor_copies():
    def contents(**kw):
        return [(b.names, b.buffer.clone()) for b in iter_buckets(iter(_weights(5)), 16 * KiB, group_by_dtype=False,
                                                                   **kw)]

    plain, fused = contents(), contents(defer_copies=True)
    assert [n for n, _ in plain] == [n for n, _ in fused]
    for (_, a), (_, b) in zip(plain, fused, strict=True):  # padding bytes are uninitialised: compare tensors
        assert a.numel() == b.numel()
    got = {n: t for b in iter_buckets(iter(_weights(5)), 16 * KiB, group_by_dtype=False, defer_copies=True)
           for n, t in b.tensors()}
    assert all(torch.equal(got[n], t) for n, t in _weights(5))
