"""rlcore's payloads, layouts, request bodies and decoders checked with SGLang 0.5.23's own code:
its deserializer (SafeUnpickler), bucket classes, weight-updater methods, request structs (through
the pydantic schema its HTTP routes use), /generate contract, ServerArgs parser and routed-experts
encoder/decoder. Needs the sglang venv (scripts/suites/sglang.sh); SGLang's engine is not started.

CUDA-IPC cannot be exercised without a GPU: the CPU (shared-memory) variant of the same payload
goes through SGLang's deserializer here, and the CUDA-specific part (the GPU UUID in place of the
device index) is checked against torch's and SGLang's code as far as that runs on CPU."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlcore_enginekit.routed_experts import decode_routed_experts
from rlcore.sync import TensorMeta, iter_buckets
from rlcore_sglang import protocol, wire
from rlcore_sglang.protocol import ServerFeatures
from rlcore_sglang.transport import engine_request, server_cli_args

pytestmark = pytest.mark.engine

NEW = ServerFeatures(version=(0, 5, 23), tp_size=2)
OLD = ServerFeatures(version=(0, 5, 20), tp_size=2)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]


# ------------------------------------------------------------------------ helpers --------


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _random_tensor(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=n).astype(np.bool_)).reshape(shape)
    raw = bytearray(rng.bytes(n * dtype.itemsize)) or bytearray(1)
    return torch.frombuffer(raw, dtype=torch.uint8)[: n * dtype.itemsize].view(dtype).reshape(shape).clone()


@st.composite
def weight_streams(draw):
    """A stream of HF-named tensors of mixed dtypes and shapes (zero-size and 0-d included)."""
    count = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    tensors = []
    for i in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
        tensors.append((f"model.layers.{i // 3}.w{i}", _random_tensor(rng, dtype, shape)))
    return tensors


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loaded = []

    def load_weights(self, named_tensors):
        self.loaded.extend(named_tensors)


def _updater(model):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    noop = lambda *a, **k: None  # noqa: E731
    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                         get_model=lambda: model, update_model_fields=noop, recapture_cuda_graph=noop,
                         get_model_runner=noop)


def _http_parse(struct_cls, body):
    """What SGLang's FastAPI route does with a JSON body: its pydantic schema builds the struct.
    SGLang ignores keys it does not know, so every key rlcore sends must be a declared field."""
    from pydantic import TypeAdapter

    obj = TypeAdapter(struct_cls).validate_json(json.dumps(body, default=protocol.json_default))
    if dataclasses.is_dataclass(struct_cls):
        known = {f.name for f in dataclasses.fields(struct_cls)}
    else:
        import msgspec

        known = {f.name for f in msgspec.structs.fields(struct_cls)}
    unknown = set(body) - known
    assert not unknown, f"{struct_cls.__name__} does not know {sorted(unknown)} (SGLang would silently drop them)"
    return obj


# --------------------------------------------------------- flattened-bucket payloads -----


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=weight_streams(), bucket_bytes=st.sampled_from([8, 48, 256, 1 << 16]), tp_size=st.integers(1, 3))
def test_sglang_deserializer_and_bucket_return_exactly_what_was_sent(sglang, stream, bucket_bytes, tp_size):
    """Every bucket, serialized once per TP rank and sent as the HTTP route receives it, comes
    back from SGLang's SafeUnpickler and its flattened-bucket loader as exactly the tensors sent."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

    features = ServerFeatures(version=(0, 5, 23), tp_size=tp_size)
    received = {}
    buckets = list(iter_buckets(iter(stream), bucket_bytes, allocator=wire.shared_memory_allocator))
    for bucket, last in zip(buckets, [False] * (len(buckets) - 1) + [True], strict=True):
        payloads = wire.serialize_per_rank(wire.flattened_bucket_payload(bucket), tp_size)
        body = protocol.update_from_tensor_body(payloads, flush_cache=last, weight_version="1" if last else None,
                                                selector="all", features=features)
        obj = _http_parse(UpdateWeightsFromTensorReqInput, body)
        assert obj.load_format == "flattened_bucket" and obj.flush_cache is last
        for rank, payload in enumerate(normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)):
            model = Recorder()
            ok, _ = _updater(model)._update_weights_from_flattened_bucket(
                flattened_tensor_bucket_dict=MultiprocessingSerializer.deserialize(payload))
            assert ok
            for name, t in model.loaded:
                received.setdefault(name, {})[rank] = t
    assert set(received) == {n for n, _ in stream}
    for name, sent in stream:
        for rank in range(tp_size):
            got = received[name][rank]
            assert got.dtype == sent.dtype and got.shape == sent.shape and _bytes(got) == _bytes(sent), name


def test_sglang_refuses_rlcore_classes_in_a_payload(sglang):
    """Why the metadata are SimpleNamespace: SGLang's allow-list unpickler blocks any other class."""
    from sglang.srt.utils import MultiprocessingSerializer

    bucket = next(iter(iter_buckets(iter([("w", torch.ones(2))]), 1 << 10, allocator=wire.shared_memory_allocator)))
    bad = {"flattened_tensor": bucket.buffer, "metadata": [TensorMeta("w", (2,), torch.float32, 0, 8)]}
    with pytest.raises(RuntimeError, match="Blocked unsafe global \\(rlcore.sync.TensorMeta\\)"):
        MultiprocessingSerializer.deserialize(wire.serialize(bad))


def test_every_global_in_our_payload_is_on_sglangs_allow_list(sglang):
    import pickle

    from sglang.srt.utils.common import SafeUnpickler

    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    for bucket in iter_buckets(iter([("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.arange(4))]), 1 << 10,
                               allocator=wire.shared_memory_allocator):
        Recording(io.BytesIO(wire.serialize(wire.flattened_bucket_payload(bucket)))).load()
    assert seen and seen <= SafeUnpickler.ALLOWED_GLOBALS, seen - SafeUnpickler.ALLOWED_GLOBALS
    # the CUDA path names torch's rebuild_cuda_tensor, also on the list
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in SafeUnpickler.ALLOWED_GLOBALS


def test_single_dtype_bucket_equals_sglangs_own_flattened_bucket(sglang):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [(f"w{i}", torch.randn(i + 1, 3, dtype=torch.bfloat16)) for i in range(5)]
    ours = next(iter(iter_buckets(iter(named), 1 << 20)))
    theirs = FlattenedTensorBucket(named_tensors=named)
    assert torch.equal(ours.buffer, theirs.get_flattened_tensor())
    for mine, meta in zip(wire.bucket_metadata(ours), theirs.get_metadata(), strict=True):
        assert (mine.name, mine.shape, mine.dtype, mine.start_idx, mine.end_idx, mine.numel) == \
            (meta.name, meta.shape, meta.dtype, meta.start_idx, meta.end_idx, meta.numel)


# ------------------------------------------------------------------------ NCCL layout -----


@settings(max_examples=40, deadline=None)
@given(stream=weight_streams(), bucket_bytes=st.sampled_from([8, 48, 256, 1 << 16]))
def test_sglang_recomputes_the_same_offsets_for_the_nccl_path(sglang, stream, bucket_bytes):
    """``FlattenedTensorBucket.empty`` (what SGLang's ranks allocate before the broadcast) gets the
    same offsets as rlcore's bucket; the broadcast bytes then reconstruct exactly."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    sent = dict(stream)
    for bucket in iter_buckets(iter(stream), bucket_bytes):
        names, dtypes, shapes = wire.nccl_bucket_metadata(bucket)
        body = protocol.update_from_distributed_body(names, dtypes, shapes, group_name="g", flush_cache=False,
                                                     weight_version=None, selector="all", features=NEW)
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        obj = _http_parse(UpdateWeightsFromDistributedReqInput, body)
        empty = FlattenedTensorBucket.empty(obj.names, obj.dtypes, obj.shapes, "cpu")
        assert [(m.start_idx, m.end_idx) for m in empty.get_metadata()] == \
            [(m.offset, m.offset + m.nbytes) for m in bucket.metas]
        empty.get_flattened_tensor().copy_(bucket.buffer)  # what the broadcast does
        for name, t in empty.reconstruct_tensors():
            assert t.dtype == sent[name].dtype and _bytes(t) == _bytes(sent[name])


# ------------------------------------------------------------------ routed experts -------


def test_routed_experts_decoder_matches_sglangs_encoding(sglang):
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    prompt, response, layers, topk = 5, 4, 3, 2
    host_rows = torch.randint(-1, 64, (prompt + response - 1, layers, topk), dtype=torch.int32)  # host cache rows
    encoded = DetokenizerManager._b64_encode_per_request([host_rows, None])
    assert encoded[1] is None
    ours = decode_routed_experts(encoded[0], rows=prompt + response - 1, layers=layers, topk=topk, packing="int32")
    assert ours.dtype == torch.int16 and torch.equal(ours, host_rows.to(torch.int16))
    theirs = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encoded[0]}})
    assert np.array_equal(theirs, ours.reshape(-1).numpy())


# ------------------------------------------------------------------- request bodies -------


def _new_bodies():
    yield "/update_weights_from_tensor", protocol.update_from_tensor_body(
        [b"\x80\x04x", b"\x80\x04y"], flush_cache=True, weight_version="3", selector="draft", features=NEW)
    yield "/update_weights_from_distributed", protocol.update_from_distributed_body(
        ["a"], ["bfloat16"], [[2, 2]], group_name="g", flush_cache=False, weight_version=None, selector="all",
        features=NEW)
    yield "/update_weights_from_disk", protocol.update_from_disk_body("/models/v3", weight_version="3")
    yield "/init_weights_update_group", protocol.init_group_body(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3, group_name="g", backend="nccl")
    yield "/destroy_weights_update_group", {"group_name": "g"}
    yield "/begin_weight_update", protocol.begin_session_body("target")
    yield "/end_weight_update", {}
    yield "/update_weight_version", {"new_version": "0", "abort_all_requests": False}
    yield "/pause_generation", {"mode": "retract"}
    yield "/continue_generation", {}
    yield "/release_memory_occupation", {"tags": ["kv_cache"]}
    yield "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]}
    for action in ("snapshot", "reset_tensors", "compare", "checksum"):
        yield "/weights_checker", protocol.weights_checker_body(action, skip=["k_scale"], selector="all", features=NEW)


def test_request_bodies_parse_with_sglangs_request_structs(sglang):
    from sglang.srt.managers import io_struct

    for route, body in _new_bodies():
        obj = _http_parse(getattr(io_struct, protocol.REQUEST_STRUCTS[route]), body)
        for key, value in body.items():
            got = getattr(obj, key)
            assert got == value or (isinstance(value, list) and list(got) == value), (route, key, got, value)
        # the in-process Engine transport builds the same struct from the same body
        assert engine_request(route, body) == obj


def test_generate_body_passes_sglangs_contract_and_sampling_checks(sglang):
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = [protocol.sampling_params(max_new_tokens=8, temperature=t, top_p=p, top_k=k, stop_token_ids=(2,), seed=s)
          for t, p, k, s in [(1.0, 1.0, -1, 7), (0.6, 0.9, 20, None), (0.0, 1.0, 0, 3)]]
    body = protocol.generate_body([[1, 2, 3], [4], [5, 6]], sp, return_routed_experts=True, processed_logprobs=True)
    assert generate_contract_error(json.loads(json.dumps(body))) is None
    obj = _http_parse(GenerateReqInput, body)
    obj.normalize_batch_and_arguments()
    assert obj.batch_size == 3 and obj.return_routed_experts and obj.return_sampling_mask
    for i in range(3):
        params = SamplingParams(**obj[i].sampling_params)
        params.verify(vocab_size=32)
        assert params.max_new_tokens == 8 and params.stop_token_ids == {2}
    assert engine_request("/generate", body).input_ids == body["input_ids"]


def _old_struct_fields():
    wheels = sorted(Path(os.environ.get("RLCORE_SGLANG_OLD_WHEEL_DIR", "")).glob("sglang-0.5.20-*.whl"))
    if not wheels:
        pytest.fail("the sglang 0.5.20 wheel is missing; scripts/suites/sglang.sh downloads it (RLCORE_SGLANG_OLD_WHEEL_DIR)")
    with zipfile.ZipFile(wheels[0]) as zf:
        tree = ast.parse(zf.read("sglang/srt/managers/io_struct.py"))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(name):
        node = classes[name]
        own = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
        return set(own).union(*(fields(b) for b in bases))

    return fields


def test_bodies_for_servers_before_the_session_use_0_5_20_fields(sglang):
    """Servers before 0.5.21 get ``disable_draft_model`` instead of ``selector`` and no
    ``skip_tensor_list``; checked against the request structs of the 0.5.20 wheel itself."""
    fields = _old_struct_fields()
    assert "selector" not in fields("UpdateWeightsFromTensorReqInput")
    bodies = {
        "UpdateWeightsFromTensorReqInput": protocol.update_from_tensor_body(
            [b"x", b"y"], flush_cache=True, weight_version="1", selector="target", features=OLD),
        "UpdateWeightsFromDistributedReqInput": protocol.update_from_distributed_body(
            ["a"], ["float32"], [[1]], group_name="g", flush_cache=True, weight_version="1", selector="all",
            features=OLD),
        "UpdateWeightFromDiskReqInput": protocol.update_from_disk_body("/m", weight_version="1"),
        "CheckWeightsReqInput": protocol.weights_checker_body("checksum", skip=[], selector="all", features=OLD),
        "InitWeightsUpdateGroupReqInput": protocol.init_group_body(
            master_address="h", master_port=1, rank_offset=1, world_size=2, group_name="g", backend="nccl"),
    }
    for struct, body in bodies.items():
        unknown = set(body) - fields(struct)
        assert not unknown, f"SGLang 0.5.20's {struct} has no {sorted(unknown)}"
    with pytest.raises(KeyError):  # and 0.5.20 has no weight-update session at all
        fields("BeginWeightUpdateReqInput")


def test_routes_rlcore_calls_exist_in_sglangs_http_server(sglang):
    from sglang.srt.entrypoints.http_server import app

    methods = {}
    for route in app.router.routes:
        methods.setdefault(getattr(route, "path", None), set()).update(getattr(route, "methods", ()) or ())
    for path in list(protocol.REQUEST_STRUCTS) + ["/flush_cache"]:
        assert "POST" in methods.get(path, set()), path
    for path in ("/server_info", "/get_server_info", "/health"):
        assert "GET" in methods.get(path, set()), path


# ---------------------------------------------------------------- launch flags ----------


def test_launch_flags_parse_with_sglangs_server_args(sglang):
    from sglang.srt.server_args import ServerArgs

    args = server_cli_args("/tmp/policy", host="127.0.0.1", port=30123, weight_version=4,
                           extra=["--tp-size", "2", "--mem-fraction-static", "0.5"], memory_saver=True,
                           routed_experts=True,
                           speculative={"speculative_algorithm": "NEXTN", "speculative_num_steps": 3,
                                        "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                                        "speculative_draft_model_path": ""})
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(args)
    assert (ns.model_path, ns.port, ns.weight_version, ns.tp_size) == ("/tmp/policy", 30123, "4", 2)
    assert ns.enable_memory_saver and ns.enable_return_routed_experts
    assert (ns.speculative_algorithm, ns.speculative_num_steps, ns.speculative_num_draft_tokens) == ("NEXTN", 3, 4)
    with pytest.raises(ValueError, match="rlcore sets itself"):
        server_cli_args("/m", host="h", port=1, weight_version=0, extra=["--port", "2"])



# ------------------------------------------------------------ the CUDA-IPC handle --------


def test_sglang_receiver_rebuilds_cuda_handles_through_its_uuid_patch(sglang):
    """rlcore's CUDA payload names torch's ``rebuild_cuda_tensor`` with a GPU UUID at argument 6.
    After SGLang's receiver-side ``monkey_patch_torch_reductions`` (which every receiving path runs
    before deserializing), that name resolves to SGLang's UUID-aware rebuild. What cannot run on
    CPU: opening a real CUDA-IPC handle."""
    from sglang.srt.utils import patch_torch
    from sglang.srt.utils.common import SafeUnpickler

    patch_torch.monkey_patch_torch_reductions()
    resolved = SafeUnpickler(io.BytesIO(b"")).find_class("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
    assert resolved is patch_torch._rebuild_cuda_tensor_modified
    assert patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX == wire.CUDA_REBUILD_DEVICE_ARG
    # SGLang's patched reducer breaks CPU tensors (it rewrites an argument they do not have);
    # rlcore's pickler uses torch's original reducer, so CPU buckets still serialize in a process
    # where SGLang has patched torch (an in-process Engine)
    bucket = next(iter(iter_buckets(iter([("w", torch.arange(6.0))]), 1 << 10,
                                    allocator=wire.shared_memory_allocator)))
    from sglang.srt.utils import MultiprocessingSerializer

    back = MultiprocessingSerializer.deserialize(wire.serialize(wire.flattened_bucket_payload(bucket)))
    assert torch.equal(back["flattened_tensor"], bucket.buffer)
