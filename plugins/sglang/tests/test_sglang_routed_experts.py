"""R3 routes from SGLang, checked against SGLang's own code (its venv, scripts/suites/sglang.sh):

* the experts a real mixed dense/MoE Qwen3-MoE chose, laid out as SGLang's routed-experts capturer
  holds them (int32, every hidden layer: a dense layer's column is never written and stays 0) and
  encoded by SGLang's ``DetokenizerManager._b64_encode_per_request`` into ``meta_info``, reach
  rlcore-replay as the rows it replays: ``len - 1`` per sequence, MoE layers only, exactly those
  experts;
* rlcore-replay's config-time reading of the speculative settings (R3 is refused with SGLang
  speculative decoding) agrees with what SGLang's own ``ServerArgs`` parser makes of the launch
  command rlcore-sglang builds."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rlcore.batch import PackedBatch, sample_routes
from rlcore.errors import RolloutError
from rlcore.types import Prompt
from rlcore_enginekit.routed_experts import moe_shape
from rlcore_sglang.backend import SGLangBackend
from rlcore_sglang.settings import SGLangSettings
from rlcore_sglang.transport import server_cli_args

pytestmark = pytest.mark.engine

PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]
RESPONSES = [[10, 11, 12], [13, 14]]


@pytest.fixture(scope="module")
def mixed_moe(tmp_path_factory):
    """Qwen3-MoE with a dense middle layer (``mlp_only_layers=[1]``): HF directory + hf engine."""
    from rlcore.testing.models import HFEngine, make_mixed_moe_dir

    path, model, tok = make_mixed_moe_dir(tmp_path_factory.mktemp("mixed-moe"))
    engine = HFEngine(model, tok, "cpu")
    assert engine.info.route_layout.layers == (0, 2)
    return path, engine


def _answer(engine, prompt, response):
    """(the experts the model chose ``[T, 2, 2]``, SGLang's ``/generate`` item carrying them)."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    with torch.no_grad():
        truth = engine.forward(PackedBatch.pack([prompt + response], [len(prompt)]), record_routes=True).routes
    layout = engine.info.route_layout
    host = torch.zeros((truth.shape[0] - 1, layout.num_hidden_layers, layout.topk), dtype=torch.int32)
    for col, layer in enumerate(layout.layers):
        host[:, layer] = truth[:-1, col].to(torch.int32)
    meta = {"id": "r", "finish_reason": {"type": "length", "length": len(response)}, "weight_version": "0",
            "prompt_tokens": len(prompt), "completion_tokens": len(response),
            "output_token_logprobs": TokenizerManager.detokenize_logprob_tokens(None, [-0.5] * len(response),
                                                                                response, False),
            "routed_experts": DetokenizerManager._b64_encode_per_request([host])[0]}
    return truth, {"text": None, "output_ids": list(response), "meta_info": meta}


def _backend(model_dir: Path) -> SGLangBackend:
    from transformers import AutoConfig

    b = SGLangBackend(SGLangSettings(), request_routed_experts=True)
    b.model_dir = str(model_dir)
    b._moe = moe_shape(AutoConfig.from_pretrained(str(model_dir)).to_dict())
    b._version = 0
    return b


def _read(backend, prompt, item):
    """One /generate answer item as the backend turns it into a Sample (routes asked for)."""
    return backend._sample(prompt, backend._parse(prompt, item, processed=False), routed=True)


def test_sglang_routes_of_a_real_model_arrive_as_the_rows_replay_uses(sglang, mixed_moe):
    model_dir, engine = mixed_moe
    backend = _backend(model_dir)
    layout = engine.info.route_layout
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        truth, item = _answer(engine, prompt, response)
        s = _read(backend, Prompt(ids=prompt, index=i), item)
        n = len(prompt) + len(response)
        assert s.routed_experts.shape == (n - 1, layout.num_hidden_layers, layout.topk)
        packed = sample_routes(s.routed_experts, layout, n, f"sample {i}")
        assert packed.shape == (n - 1, 2, 2), "len - 1 rows, MoE layers only"
        assert torch.equal(packed.long(), truth[:-1].long()), "exactly the experts the model chose"
    # an answer without routes (they were asked for) is an error naming the prompt
    _, item = _answer(engine, PROMPTS[0], RESPONSES[0])
    del item["meta_info"]["routed_experts"]
    with pytest.raises(RolloutError, match="prompt 0: none were returned"):
        _read(backend, Prompt(ids=PROMPTS[0], index=0), item)
    # one row short (SGLang's routed_experts_start_len would cut a prefix): an error, never realigned
    _, item = _answer(engine, PROMPTS[0], RESPONSES[0][:-1])
    item["output_ids"] = RESPONSES[0]
    item["meta_info"]["output_token_logprobs"].append([-0.5, RESPONSES[0][-1], None])
    with pytest.raises(RolloutError, match="rows"):
        _read(backend, Prompt(ids=PROMPTS[0], index=0), item)


@pytest.mark.parametrize("settings,launch_args", [
    ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 4}, []),
    ({"speculative_algorithm": "EAGLE3"}, []),
    ({}, ["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk=2"]),
    ({"speculative_algorithm": "NGRAM"}, ["--speculative-eagle-topk", "1"]),
    ({}, []),
])
def test_the_config_checks_reading_of_speculation_matches_sglangs_parser(sglang, settings, launch_args):
    from omegaconf import OmegaConf
    from rlcore_sglang.settings import sglang_speculation
    from sglang.srt.server_args import ServerArgs

    s = replace(SGLangSettings(), launch_args=launch_args, **settings)
    speculative = {k: getattr(s, k) for k in ("speculative_algorithm", "speculative_draft_model_path",
                                              "speculative_num_steps", "speculative_eagle_topk",
                                              "speculative_num_draft_tokens")}
    argv = server_cli_args("/m", host="127.0.0.1", port=30000, weight_version=0, extra=launch_args,
                           routed_experts=True, speculative=speculative)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    algo, topk = sglang_speculation(OmegaConf.structured(s))
    assert algo == (ns.speculative_algorithm or "").upper()
    assert topk == ns.speculative_eagle_topk  # None: left to SGLang's choice by architecture
