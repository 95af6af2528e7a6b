"""The core bucket builder and checksums (every weight-sync plugin relies on them)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.sync import iter_buckets, tensor_checksum, verify_checksums

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.int32]

tensors_st = st.lists(
    st.tuples(st.sampled_from(range(len(DTYPES))), st.lists(st.integers(1, 9), min_size=0, max_size=3)),
    min_size=1, max_size=25,
)


def _make(spec):
    g = torch.Generator().manual_seed(len(spec))
    out = []
    for i, (d, shape) in enumerate(spec):
        t = (torch.randn(shape or [1], generator=g) * 100).to(DTYPES[d])
        out.append((f"layer.{i}.w", t.reshape(shape) if shape else t.reshape(())))
    return out


@settings(max_examples=80, deadline=None)
@given(tensors_st, st.integers(8, 600), st.sampled_from([None, 16, 64]))
def test_every_tensor_round_trips_in_aligned_dtype_pure_buckets(spec, bucket_bytes, align):
    named = _make(spec)
    buckets = list(iter_buckets(iter(named), bucket_bytes, align_bytes=align))
    got = {}
    for b in buckets:
        assert all(m.dtype == b.dtype for m in b.metas), "one dtype per bucket"
        assert b.nbytes <= bucket_bytes or len(b.metas) == 1, "only a single oversize tensor may exceed the size"
        for m in b.metas:
            assert m.offset % (align or torch.tensor([], dtype=m.dtype).element_size()) == 0
        for name, view in b.tensors():
            got[name] = view.clone()
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert set(got) == {n for n, _ in named}
    for n, t in named:
        assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t)


def test_without_alignment_buckets_are_contiguous_like_sglangs_empty():
    named = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(5, dtype=torch.bfloat16))]
    (b,) = list(iter_buckets(named, 1 << 20))
    assert [(m.offset, m.nbytes) for m in b.metas] == [(0, 6), (6, 10)] and b.nbytes == 16


def test_keep_together_never_splits_a_group():
    named = [(f"l0.{k}", torch.zeros(10)) for k in "qkv"] + [("l1.q", torch.zeros(10))]
    buckets = list(iter_buckets(named, 100, keep_together=lambda n: n.split(".")[0]))
    groups = [sorted({n.split(".")[0] for n in b.names}) for b in buckets]
    assert ["l0"] in groups and all(len(g) == 1 for g in groups)
    assert any(set(b.names) == {"l0.q", "l0.k", "l0.v"} for b in buckets)


def test_oversize_tensor_travels_alone_and_stream_is_lazy():
    consumed = []

    def stream():
        for i in range(4):
            consumed.append(i)
            yield f"t{i}", torch.zeros(100 if i == 1 else 2)

    it = iter_buckets(stream(), 64)
    first = next(it)
    assert first.names == ["t1"] and first.nbytes == 400
    # lazy: one tensor of look-ahead (to see where a keep_together group ends), never the whole stream
    assert consumed == [0, 1, 2]


def test_allocator_places_buckets():
    seen = []

    def alloc(nbytes, device):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        seen.append(buf.data_ptr())
        return buf

    b = next(iter_buckets([("w", torch.ones(4))], 64, allocator=alloc))
    assert b.buffer.data_ptr() == seen[0]


def test_checksum_detects_any_change_and_is_order_sensitive():
    t = torch.randn(1000)
    c = tensor_checksum(t)
    assert tensor_checksum(t.clone()) == c
    u = t.clone()
    u[517] = torch.nextafter(u[517], torch.tensor(1e9))  # a single-ulp change
    assert tensor_checksum(u) != c
    assert tensor_checksum(t.flip(0)) != c
    assert tensor_checksum(torch.zeros(3)) != tensor_checksum(torch.zeros(4))
    assert tensor_checksum(t.to(torch.bfloat16)) == tensor_checksum(t.to(torch.bfloat16).view(torch.int16))


def test_verify_checksums_reports_mismatches():
    assert verify_checksums({"a": 1, "b": 2}, {"a": 1, "b": 2}) == []
    assert verify_checksums({"a": 1, "b": 2}, {"a": 1, "b": 3}) == ["b"]
    assert verify_checksums({"a": 1}, {}) == ["a"]


def test_bucket_rejects_non_tensors():
    with pytest.raises(TypeError, match="weight 'x' is a list"):
        list(iter_buckets([("x", [1, 2])], 10))


def _checksum_by_definition(t):
    """tensor_checksum's documented definition, in plain Python (receivers in other processes
    and languages can reimplement it from this)."""
    import struct

    raw = bytes(t.contiguous().view(torch.uint8).tolist())
    raw += b"\0" * ((-len(raw)) % 4)
    words = struct.unpack(f"<{len(raw) // 4}i", raw)
    P = (1 << 31) - 1
    s1 = sum(words) % P
    s2 = sum(w * ((i % 65521) + 1) for i, w in enumerate(words)) % P
    return (s1 << 31) | (s2 ^ (len(words) & 0x7FFFFFFF))


@pytest.mark.parametrize("n,dtype", [(1, torch.uint8), (7, torch.bfloat16), (65521 + 3, torch.float32), (3 * 65521, torch.int64)])
def test_checksum_matches_its_definition(n, dtype):
    t = (torch.randn(n) * 1000).to(dtype)
    assert tensor_checksum(t) == _checksum_by_definition(t)
