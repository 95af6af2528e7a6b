"""PackedBatch: pack/unpack/roll/micro-batching properties (hypothesis) and shape errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.batch import PackedBatch, PackedLayout
from rlcore.errors import BatchShapeError

seqs_st = st.lists(st.integers(2, 12), min_size=1, max_size=8).flatmap(
    lambda lens: st.tuples(
        st.just(lens),
        st.lists(st.integers(1, 11), min_size=len(lens), max_size=len(lens)),
        st.integers(1, 4),
    )
)


def _build(lens, starts_raw, align):
    seqs = [torch.arange(100 * i, 100 * i + n) for i, n in enumerate(lens)]
    starts = [min(max(1, s), n - 1) for s, n in zip(starts_raw, lens)]
    resp_lp = [torch.arange(n - s, dtype=torch.float32) + 0.5 for s, n in zip(starts, lens)]
    routes = [torch.arange(n - 1).view(-1, 1, 1).expand(n - 1, 2, 3).to(torch.int16) for n in lens]
    b = PackedBatch.pack(seqs, starts, target_fields={"lp": resp_lp}, input_fields={"routes": routes}, align=align)
    return seqs, starts, b


@settings(max_examples=60, deadline=None)
@given(seqs_st)
def test_pack_unpack_round_trip_and_alignment(case):
    lens, starts_raw, align = case
    seqs, starts, b = _build(lens, starts_raw, align)
    assert b.num_seqs == len(seqs)
    assert all(int(p) % align == 0 for p in b.layout.padded_lens)
    for orig, got in zip(seqs, b.unpack(b.input_ids)):
        assert torch.equal(orig, got)
    pos = b.unpack(b.position_ids())
    assert all(torch.equal(p, torch.arange(len(p))) for p in pos)


@settings(max_examples=60, deadline=None)
@given(seqs_st)
def test_labels_and_loss_mask_never_cross_sequences(case):
    lens, starts_raw, align = case
    seqs, starts, b = _build(lens, starts_raw, align)
    for seq, s, lab, mask, lp in zip(seqs, starts, b.unpack(b.labels()), b.unpack(b.loss_mask), b.unpack(b.fields["lp"])):
        n = len(seq)
        assert torch.equal(lab[:-1], seq[1:])  # position t predicts token t + 1 ...
        assert not mask[-1]                      # ... and the last position predicts nothing
        expected_mask = torch.zeros(n, dtype=torch.bool)
        expected_mask[s - 1:n - 1] = True
        assert torch.equal(mask, expected_mask)
        # target fields are label-aligned: the value for response token j sits at s - 1 + j
        assert torch.equal(lp[s - 1:n - 1], torch.arange(n - s, dtype=torch.float32) + 0.5)
        assert torch.all(lp[~expected_mask] == 0)


@settings(max_examples=40, deadline=None)
@given(seqs_st, st.sampled_from([-2, -1, 1, 3]))
def test_roll_is_packed_aware(case, shift):
    lens, starts_raw, align = case
    seqs, _, b = _build(lens, starts_raw, align)
    rolled = b.unpack(b.roll(b.input_ids, shift, fill=-7))
    for seq, r in zip(seqs, rolled):
        expect = torch.full_like(seq, -7)
        if shift < 0:
            expect[: len(seq) + shift] = seq[-shift:]
        else:
            expect[shift:] = seq[: len(seq) - shift]
        assert torch.equal(r, expect)
    # padding positions always get the fill value
    assert torch.all(b.roll(b.input_ids, shift, fill=-7)[~b.layout.valid()] == -7)


@settings(max_examples=40, deadline=None)
@given(seqs_st, st.integers(1, 40))
def test_micro_batches_cover_everything_within_budget(case, budget):
    lens, starts_raw, align = case
    _, _, b = _build(lens, starts_raw, align)
    mbs = b.micro_batches(budget)
    assert sum(m.num_seqs for m in mbs) == b.num_seqs
    assert torch.equal(torch.cat([m.input_ids for m in mbs]), b.input_ids)
    assert torch.equal(torch.cat([m.fields["routes"] for m in mbs]), b.fields["routes"])
    for m in mbs:
        assert m.num_tokens <= budget or m.num_seqs == 1
        assert torch.equal(m.labels(), b.labels()[m.token_offset: m.token_offset + m.num_tokens])


def test_routes_input_fields_fill_last_row():
    b = PackedBatch.pack([[1, 2, 3]], [1], input_fields={"routes": [torch.ones(2, 4, 2, dtype=torch.int16)]})
    assert b.fields["routes"].shape == (3, 4, 2)
    assert torch.all(b.fields["routes"][2] == -1)


def test_write_back_places_micro_batch_rows():
    b = PackedBatch.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [1, 1, 1])
    for m in b.micro_batches(4):
        b.write_back(m, "rec", m.input_ids * 10)
    assert torch.equal(b.fields["rec"], b.input_ids * 10)


def test_shape_errors_say_what_was_expected():
    with pytest.raises(BatchShapeError, match=r"target field 'lp'\[0\] has 5 rows; expected 3 \(whole sequence\) or 2"):
        PackedBatch.pack([[1, 2, 3]], [1], target_fields={"lp": [torch.zeros(5)]})
    with pytest.raises(BatchShapeError, match=r"response_starts\[0\]=4 must be in \[1, 3\]"):
        PackedBatch.pack([[1, 2, 3]], [4])
    with pytest.raises(BatchShapeError, match=r"input field 'routes'\[0\] has 7 rows; expected 3 or 2"):
        PackedBatch.pack([[1, 2, 3]], [1], input_fields={"routes": [torch.zeros(7, 1, 1)]})
    b = PackedBatch.pack([[1, 2, 3]], [1])
    with pytest.raises(BatchShapeError, match=r"roll expects a tensor with T=3 rows"):
        b.roll(torch.zeros(4))
    with pytest.raises(BatchShapeError, match="every packed sequence needs at least one token"):
        PackedLayout.from_lengths([3, 0])


def test_align_total_pads_last_sequence():
    b = PackedBatch.pack([[1, 2, 3], [4, 5]], [1, 1], align=2, align_total=8)
    assert b.num_tokens == 8 and b.layout.padded_lens.tolist() == [4, 4]
    assert b.unpack(b.input_ids)[1].tolist() == [4, 5]


# ---- compact routes: uint8 ids up to 256 experts, int16 beyond, native mask --------------------


@pytest.mark.parametrize("num_experts,dtype", [(8, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                               (32768, torch.int16), (40000, torch.int32)])
def test_compact_routes_round_trip_in_the_smallest_dtype(num_experts, dtype):
    from rlcore.batch import compact_routes, expand_routes, route_id_dtype

    g = torch.Generator().manual_seed(num_experts)
    routes = torch.stack([torch.randperm(num_experts, generator=g)[:4] for _ in range(6 * 3)]).view(6, 3, 4)
    routes[5] = -1  # the last token of a sequence: routes natively
    routes[2, 1] = -1  # one layer of one token without a route
    assert route_id_dtype(num_experts) == dtype
    ids, native = compact_routes(routes, num_experts)
    assert ids.dtype == dtype and native.dtype == torch.bool and native.shape == (6, 3)
    assert native[5].all() and native[2, 1] and int(native.sum()) == 4
    assert torch.equal(expand_routes(ids, native), routes.long())
    assert ids.numel() * ids.element_size() + native.numel() == 6 * (3 * 4 * dtype.itemsize + 3)
    if num_experts < 256:  # a native row read raw is an out-of-range id, refused by every router
        assert int(ids[5].min()) == num_experts


def test_routes_of_reads_compact_and_plain_fields_and_refuses_unmasked_uint8():
    from rlcore.batch import compact_routes, routes_of

    routes = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]])
    ids, native = compact_routes(routes, 4)
    assert torch.equal(routes_of({"routes": ids, "routes_native": native}), routes)
    assert torch.equal(routes_of({"routes": routes.to(torch.int16)}), routes)  # plain signed: -1 kept
    assert routes_of({}) is None
    with pytest.raises(BatchShapeError, match="uint8 expert ids but no 'routes_native' mask"):
        routes_of({"routes": ids})


def test_compact_routes_follow_micro_batches_and_devices():
    from rlcore.batch import compact_routes

    routes = [torch.tensor([[[1, 2]], [[3, 0]]], dtype=torch.int16), torch.tensor([[[2, 1]]], dtype=torch.int16)]
    b = PackedBatch.pack([[1, 2, 3], [4, 5]], [1, 1], input_fields={"routes": routes})
    b.fields["routes"], b.fields["routes_native"] = compact_routes(b.fields["routes"], 4)
    full = b.routes()
    mbs = b.micro_batches(3)
    assert len(mbs) == 2 and torch.equal(torch.cat([m.routes() for m in mbs]), full)
    assert full[2].eq(-1).all() and full[4].eq(-1).all()  # each sequence's last token
    assert torch.equal(b.to("cpu").routes(), full)
