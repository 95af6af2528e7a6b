"""Core's built-in providers pass the same conformance suites that plugins subclass."""

import pytest

from rlcore.builtin import disk, inproc, local, reference
from rlcore.engines.hf import HFEngine
from rlcore.heads import ReferenceHead
from rlcore.rollout_local import LocalRollout
from rlcore.testing.conformance import (
    EngineConformance,
    ForwardFnConformance,
    RolloutBackendConformance,
    WeightSyncConformance,
)
from rlcore.weight_sync import DiskSync, InprocSync


def _spec(module):
    hook = [h for h in ("forward_fn", "rollout_backend", "weight_sync", "engine") if hasattr(module, h)][0]
    return next(iter(getattr(module, hook)()))


class TestReferenceHead(ForwardFnConformance):
    capabilities = _spec(reference).capabilities
    factory_path = "rlcore.heads:ReferenceHead"

    @pytest.fixture(params=[2048, 5], ids=["one-chunk", "chunked"])
    def forward_fn(self, request):
        return ReferenceHead(chunk_tokens=request.param)


class TestLocalRollout(RolloutBackendConformance):
    capabilities = _spec(local).capabilities

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return lambda: LocalRollout(seed=0)


class TestInprocSync(WeightSyncConformance):
    capabilities = _spec(inproc).capabilities

    @pytest.fixture(scope="class")
    @classmethod
    def sync_factory(cls):
        return lambda: InprocSync(bucket_bytes=64 * 1024)  # small buckets: many per push

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return lambda: LocalRollout(seed=0)


class TestDiskSync(WeightSyncConformance):
    capabilities = _spec(disk).capabilities

    @pytest.fixture(scope="class")
    @classmethod
    def sync_factory(cls, tmp_path_factory):
        root = tmp_path_factory.mktemp("disk-sync")
        return lambda: DiskSync(root, bucket_bytes=256 * 1024)

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return lambda: LocalRollout(seed=0)


class TestHFEngine(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        return lambda d: HFEngine.from_pretrained(d)
