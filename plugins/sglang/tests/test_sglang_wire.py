"""Payload construction without SGLang (main venv and sglang venv): what the flattened-bucket
payload references, its metadata, the GPU-UUID substitution, the NCCL layout rule and the
routed-experts decoder. test_sglang_engine_wire.py runs the same payloads through SGLang's own
deserializer and bucket classes."""

from __future__ import annotations

import inspect
import io
import pickle

import pytest
import torch
import torch.multiprocessing.reductions as torch_reductions
from rlcore.sync import iter_buckets
from rlcore_sglang import wire

MIXED = [
    ("model.embed_tokens.weight", torch.randn(7, 3, dtype=torch.bfloat16)),
    ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(5, dtype=torch.float32)),
    ("model.layers.0.self_attn.q_proj.weight", torch.randn(3, 3, dtype=torch.bfloat16)),
    ("model.layers.0.tokens_seen", torch.arange(3, dtype=torch.int64)),
    ("lm_head.weight", torch.randn(1, 3, dtype=torch.bfloat16)),
]


class RecordingUnpickler(pickle.Unpickler):
    """Records every global the payload names (what an allow-list unpickler would be asked)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.globals: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.globals.add((module, name))
        return super().find_class(module, name)


def _buckets(bucket_bytes=64):
    return list(iter_buckets(iter(MIXED), bucket_bytes, allocator=wire.shared_memory_allocator))


def test_payload_names_only_torch_and_stdlib_globals_and_round_trips():
    seen: set[tuple[str, str]] = set()
    sent = dict(MIXED)
    for bucket in _buckets():
        assert bucket.buffer.is_shared(), "CPU buckets must be born in shared memory"
        payload = wire.serialize(wire.flattened_bucket_payload(bucket))
        assert len(payload) < 4096, "the tensor must travel as a handle, not as bytes"
        up = RecordingUnpickler(payload)
        obj = up.load()
        seen |= up.globals
        flat = obj["flattened_tensor"]
        for meta in obj["metadata"]:
            assert type(meta).__name__ == "SimpleNamespace" and isinstance(meta.shape, torch.Size)
            assert meta.numel == meta.end_idx - meta.start_idx  # bytes, as SGLang's own bucket counts
            got = flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)
            assert torch.equal(got, sent[meta.name])
    modules = {m for m, _ in seen}
    assert not any(m.startswith("rlcore") for m in modules), seen
    assert ("types", "SimpleNamespace") in seen and ("torch", "Size") in seen
    assert modules <= {"builtins", "copyreg", "types", "torch", "torch.storage", "torch._utils",
                       "torch.multiprocessing.reductions"}, seen
    # CPU storages travel by shared-memory file name, not as a descriptor passed over a socket
    assert ("torch.multiprocessing.reductions", "rebuild_storage_filename") in seen


def test_metadata_fields_match_sglang_flattened_tensor_metadata():
    bucket = _buckets(1 << 20)[0]
    meta = wire.bucket_metadata(bucket)
    assert [vars(m).keys() for m in meta][0] == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
    assert [m.name for m in meta] == [n for n, t in MIXED if t.dtype == bucket.dtype]


def test_cuda_handle_device_argument_is_torchs_storage_device():
    # torch's own function, also after SGLang's receiver patch replaced it in this process (the engine tests)
    rebuild = getattr(torch_reductions, "_rebuild_cuda_tensor_original", torch_reductions.rebuild_cuda_tensor)
    params = list(inspect.signature(rebuild).parameters)
    assert params[wire.CUDA_REBUILD_DEVICE_ARG] == "storage_device"


def test_device_index_becomes_the_gpu_uuid():
    args = tuple(range(15))  # the 15 arguments of rebuild_cuda_tensor, device index 6
    out = wire.with_device_uuid(args, uuid_of=lambda i: f"GPU-{i}-uuid")
    assert out[wire.CUDA_REBUILD_DEVICE_ARG] == "GPU-6-uuid"
    assert out[:6] == args[:6] and out[7:] == args[7:]
    already = args[:6] + ("GPU-x",) + args[7:]
    assert wire.with_device_uuid(already, uuid_of=lambda i: pytest.fail("must not look up")) == already
    with pytest.raises(TypeError, match="expected a device index"):
        wire.with_device_uuid(args[:6] + (None,) + args[7:])


def test_nccl_metadata_is_the_contiguous_layout_sglang_recomputes():
    for bucket in _buckets():
        names, dtypes, shapes = wire.nccl_bucket_metadata(bucket)
        offset = 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            meta = next(m for m in bucket.metas if m.name == name)
            assert meta.offset == offset and getattr(torch, dtype) == meta.dtype and list(meta.shape) == shape
            offset += meta.nbytes
        assert offset == bucket.nbytes
    padded = next(iter(iter_buckets(iter(MIXED[:1] + MIXED[2:3]), 1 << 20, align_bytes=64)))
    with pytest.raises(ValueError, match="starts at byte 64, but SGLang's receiver places it at 42"):
        wire.nccl_bucket_metadata(padded)


def test_dtype_names():
    assert wire.dtype_name(torch.bfloat16) == "bfloat16" and wire.dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
