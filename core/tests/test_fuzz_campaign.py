"""Hypothesis campaign over what users and plugins hand to rlcore: configs (types, ranges,
unknown keys), packing (empty, single-token, very long, all-masked), bucketing (tensors larger
than a bucket, zero-size tensors, odd dtypes) and routes (wrong shapes, duplicates,
out-of-range ids). The rule: an input is either accepted, and then it behaves (invariants
checked), or refused with one of rlcore's errors (rlcore.errors), never another exception.

What the campaign found and how it was fixed is in docs/reliability.md. ``max_examples`` is
bounded so the file runs in well under a minute on the CI machine; set
``HYPOTHESIS_PROFILE=campaign`` for the long run recorded there."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlcore.batch import PackedBatch, sample_routes
from rlcore.errors import RLCoreError
from rlcore.sync import iter_buckets, tensor_checksum

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("campaign", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _rlcore_error_or_ok(fn, *args, **kw):
    """Run ``fn``; return its result, or None when it raised an rlcore error. Anything else fails."""
    try:
        return fn(*args, **kw)
    except RLCoreError:
        return None


# ---------------------------------------------------------------------------------- configs ----

def _known_keys() -> list[str]:
    from omegaconf import OmegaConf

    from rlcore.config import RunConfig

    out = []

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            out.append(prefix[:-1])

    walk("", OmegaConf.to_container(OmegaConf.structured(RunConfig)))
    return out


KNOWN = _known_keys()
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "k3", "token-mean", "grpo", "stop", "skip", "rlcore.tasks:successor", "1e400", "-1"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=2))
keys = st.one_of(st.sampled_from(KNOWN), st.sampled_from(KNOWN).map(lambda k: k + "x"),
                 st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}", fullmatch=True))


def _nest(flat: dict) -> dict:
    root: dict = {}
    for key, val in flat.items():
        node = root
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = val
    return root


def _load(doc_path=None, overrides=()):
    from rlcore.manager import PluginManager
    from rlcore.stack import load_config, resolve

    pm = PluginManager(autoload=False)
    pm.load_builtins()
    cfg, pm = load_config(doc_path, overrides, plugins=pm)
    return resolve(cfg, pm)


def _check_accepted(stack) -> None:
    """An accepted config is one the run can use: every float finite, every count positive."""
    from omegaconf import OmegaConf

    from rlcore.config import training_fingerprint

    cfg = stack.config
    flat = training_fingerprint(cfg)
    for k, v in flat.items():
        if isinstance(v, float):
            assert math.isfinite(v), f"{k}={v} accepted"
    assert cfg.training.on_nonfinite in ("stop", "skip")
    assert cfg.output.keep_checkpoints >= 1 and cfg.output.checkpoint_every >= 0
    assert 0 < int(cfg.sync.bucket_mb * (1 << 20)) < 2**63
    assert OmegaConf.to_yaml(cfg)


@given(st.dictionaries(keys, values, max_size=4))
def test_config_documents_are_accepted_or_refused_with_a_config_error(tmp_path_factory, flat):
    import yaml

    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    try:
        text = yaml.safe_dump(_nest(flat))
    except Exception:  # noqa: BLE001 - yaml cannot write it: not an input a user can give
        assume(False)
    path.write_text(text)
    stack = _rlcore_error_or_ok(_load, str(path))
    if stack is not None:
        _check_accepted(stack)


@given(st.lists(st.tuples(keys, st.text(max_size=10)), max_size=3))
def test_command_line_overrides_are_accepted_or_refused_with_a_config_error(pairs):
    stack = _rlcore_error_or_ok(_load, None, [f"{k}={v}" for k, v in pairs])
    if stack is not None:
        _check_accepted(stack)


@pytest.mark.parametrize("override", [
    "training.lr=nan", "training.lr=-1", "rollout.temperature=inf", "sync.bucket_mb=1e300", "training.seed=-1",
    "training.betas=[0.9]", "training.betas=[0.9,1.5]", "output.keep_checkpoints=0", "training.on_nonfinite=ignore",
    "algorithm.kl_coef=-0.1", "training.grad_clip=nan", "output.checkpoint_every=-1", "algorithm.clip_low=1.5",
    "training.betas={}", "training=[]", "engine.model.tiny=[1]", "engine.model.tiny.init_std=INF",
    "engine.model.tiny.hidden_size=0", "training.betas=[0.9,nan]",
])
def test_out_of_range_values_name_their_key(override):
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _load(None, [override])
    assert override.split("=")[0] in str(e.value)


# ---------------------------------------------------------------------------------- packing ----

token_ids = st.integers(min_value=0, max_value=50_000)
sequences = st.lists(st.lists(token_ids, min_size=0, max_size=12), min_size=0, max_size=6)


@st.composite
def pack_inputs(draw):
    seqs = draw(st.one_of(sequences, st.lists(st.lists(token_ids, min_size=2000, max_size=5000), max_size=2)))
    starts = [draw(st.one_of(st.integers(min_value=1, max_value=max(len(s), 1)),  # valid
                             st.integers(min_value=-2, max_value=len(s) + 2)))     # maybe not
              for s in seqs]
    if draw(st.booleans()):
        starts = [len(s) for s in seqs]  # all-masked: empty responses
    return seqs, starts, draw(st.integers(min_value=-1, max_value=8)), draw(st.integers(min_value=-1, max_value=64))


@given(pack_inputs())
def test_packing_is_exact_or_refused(inp):
    seqs, starts, align, max_tokens = inp
    batch = _rlcore_error_or_ok(
        PackedBatch.pack, seqs, starts, align=align,
        target_fields={"adv": [torch.full((len(s),), 0.5) for s in seqs]},
    )
    if batch is None:
        return
    assert [p.tolist() for p in batch.unpack(batch.input_ids)] == seqs
    assert batch.num_loss_tokens == sum(len(s) - rs for s, rs in zip(seqs, starts))
    assert batch.num_tokens % max(align, 1) == 0
    labels = batch.labels()
    for seq, piece in zip(seqs, batch.unpack(labels)):
        assert piece[:-1].tolist() == seq[1:], "rolling never crosses a sequence boundary"
    mbs = _rlcore_error_or_ok(batch.micro_batches, max_tokens)
    if mbs is None:
        assert max_tokens < 1
        return
    assert sum(mb.num_seqs for mb in mbs) == batch.num_seqs
    assert sum(mb.num_tokens for mb in mbs) == batch.num_tokens


@given(st.one_of(
    st.just([[]]), st.just([[5]]), st.just([[1.5, 2.0]]), st.just([[-3, 4]]), st.just([[[1, 2], [3, 4]]]),
    st.just([[True, False]]), st.just([["a", "b"]]), st.just([[2**70, 1]]),
))
def test_odd_token_ids_are_refused_or_packed(seqs):
    batch = _rlcore_error_or_ok(PackedBatch.pack, seqs, [1] * len(seqs))
    if batch is not None:
        assert batch.input_ids.dtype == torch.long and int(batch.input_ids.min()) >= 0


@given(st.lists(st.one_of(st.just(0), st.integers(1, 5)), min_size=1, max_size=4), st.sampled_from([0, 1, 2]))
def test_target_and_input_fields_of_any_shape_are_refused_or_placed(rows, ndim):
    seqs = [[1, 2, 3, 4]] * len(rows)
    vals = [torch.zeros((r,) + (2,) * (ndim - 1)) if ndim else torch.tensor(float(r)) for r in rows]
    for kind in ("target_fields", "input_fields"):
        batch = _rlcore_error_or_ok(PackedBatch.pack, seqs, [2] * len(seqs), **{kind: {"f": vals}})
        if batch is not None:
            assert batch.fields["f"].shape[0] == batch.num_tokens


# -------------------------------------------------------------------------------- bucketing ----

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.bool,
          torch.int64, torch.complex64, torch.float8_e4m3fn, torch.uint16, torch.int32]


@st.composite
def named_tensors(draw):
    n = draw(st.integers(min_value=0, max_value=8))
    out = []
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=3)))
        t = torch.zeros(shape, dtype=torch.float32).uniform_(-1, 1).to(dtype) if dtype != torch.bool else \
            torch.zeros(shape, dtype=torch.bool)
        if len(shape) == 2 and draw(st.booleans()):
            t = t.t()  # non-contiguous
        out.append((draw(st.sampled_from([f"w{i}", "w0", "layers.0.q", ""])), t))
    return out


@given(named_tensors(), st.integers(min_value=-1, max_value=600), st.one_of(st.none(), st.integers(-1, 20)))
def test_buckets_round_trip_every_tensor_or_refuse(tensors, bucket_bytes, align):
    buckets = _rlcore_error_or_ok(lambda: list(iter_buckets(tensors, bucket_bytes, align_bytes=align)))
    if buckets is None:
        return
    assert sum(len(b.metas) for b in buckets) == len(tensors)
    by_pos = {}
    for b in buckets:
        for m in b.metas:
            by_pos.setdefault(m.name, []).append(b.view(m))
    def raw(x):
        return x.contiguous().reshape(-1).view(torch.uint8)

    for name, t in tensors:
        match = [g for g in by_pos[name] if g.shape == t.shape and g.dtype == t.dtype and torch.equal(raw(g), raw(t))]
        assert match, f"{name} {tuple(t.shape)} {t.dtype} arrived intact"
    for b in buckets:  # checksums read views in place: those at offsets not a multiple of 4 too
        for _, view in b.tensors():
            if view.storage_offset() * view.element_size() % 4:
                assert tensor_checksum(view) == tensor_checksum(view.clone())
    for b in buckets:  # over capacity only for one tensor (or one same-name group) travelling alone
        assert b.nbytes <= bucket_bytes or len({m.name for m in b.metas}) == 1


@given(st.sampled_from(["sparse", "meta", "not a tensor", "scalar"]))
def test_odd_objects_in_the_weight_stream_are_refused_or_bucketed(kind):
    t = {"sparse": torch.eye(3).to_sparse(), "meta": torch.empty(3, device="meta"), "not a tensor": [1.0],
         "scalar": torch.tensor(2.0)}[kind]
    buckets = _rlcore_error_or_ok(lambda: list(iter_buckets([("w", t)], 64)))
    if buckets is not None:
        (b,) = buckets
        assert torch.equal(b.view(b.metas[0]), t)


# ----------------------------------------------------------------------------------- routes ----

class _Layout:
    """The duck type sample_routes needs (rlcore.types.RouteLayout's select/num_experts/topk)."""

    def __init__(self, layers, topk, num_experts, num_hidden_layers):
        from rlcore.types import RouteLayout

        self.inner = RouteLayout(tuple(layers), topk, num_experts, num_hidden_layers)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@st.composite
def route_inputs(draw):
    num_experts = draw(st.integers(min_value=1, max_value=70_000))
    topk = draw(st.integers(min_value=1, max_value=4))
    hidden = draw(st.integers(min_value=1, max_value=4))
    layers = sorted(draw(st.sets(st.integers(0, hidden - 1), min_size=1, max_size=hidden)))
    seq_len = draw(st.integers(min_value=2, max_value=6))
    rows = draw(st.sampled_from([seq_len, seq_len - 1, seq_len + 1, 0]))
    shape = draw(st.sampled_from([(rows, hidden, topk), (rows, hidden, topk + 1), (rows, topk), (rows, hidden + 1, topk)]))
    ids = draw(st.lists(st.integers(min_value=-3, max_value=num_experts + 2), min_size=math.prod(shape),
                        max_size=math.prod(shape)))
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32]))
    raw = torch.tensor(ids, dtype=torch.int64).reshape(shape)
    raw = raw.to(dtype) if dtype != torch.int16 else raw.clamp(-32768, 32767).to(dtype)
    return _Layout(layers, topk, num_experts, hidden), raw, seq_len


@given(route_inputs())
def test_rollout_routes_are_checked_before_they_reach_a_batch(inp):
    layout, raw, seq_len = inp
    routes = _rlcore_error_or_ok(sample_routes, raw, layout, seq_len, "sample 0")
    if routes is None:
        return
    assert routes.shape[1:] == (layout.num_routed, layout.topk) and routes.shape[0] in (seq_len, seq_len - 1)
    assert not routes.is_floating_point()
    assert int(routes.min()) >= -1 and int(routes.max()) < layout.num_experts
    chosen = routes.long()
    for row in chosen.reshape(-1, layout.topk).tolist():
        picked = [e for e in row if e >= 0]
        assert len(picked) == len(set(picked)), f"duplicate experts {row} accepted"
    batch = PackedBatch.pack([list(range(seq_len))], [1], input_fields={"routes": [routes]})
    assert torch.equal(batch.fields["routes"][: routes.shape[0]].long(), chosen)


@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 9),
       st.lists(st.integers(-2, 10), min_size=0, max_size=40), st.sampled_from([torch.int64, torch.float32]))
def test_router_hook_answers_are_applied_or_refused(num_tokens, topk, num_experts, ids, dtype):
    from rlcore.engines.routing import apply_router_decision
    from rlcore.types import RouterDecision

    n = num_tokens * topk
    forced = torch.tensor((ids + [0] * n)[:n] if len(ids) >= n // 2 else ids, dtype=dtype)
    if forced.numel() == n:
        forced = forced.reshape(num_tokens, topk)
    native = torch.stack([torch.randperm(max(num_experts, topk))[:topk] for _ in range(num_tokens)])
    native = native.clamp(max=num_experts - 1)
    assume(all(len(set(r)) == topk for r in native.tolist()))
    out = _rlcore_error_or_ok(apply_router_decision, RouterDecision(indices=forced), native, layer=0,
                              num_experts=num_experts, topk=topk, num_tokens=num_tokens, to_rows=lambda x: x)
    if out is not None:
        assert out.shape == (num_tokens, topk) and int(out.min()) >= 0 and int(out.max()) < num_experts
