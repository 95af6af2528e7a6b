"""Request bodies, version gates and answer parsing, without SGLang (main venv and sglang venv).
That SGLang's own request structs accept these bodies is checked in test_sglang_engine_wire.py."""

from __future__ import annotations

import json

import pytest
from rlcore_enginekit.serving import answer_message
from rlcore_sglang import protocol
from rlcore_sglang.protocol import ServerFeatures, parse_version

NEW = ServerFeatures(version=(0, 5, 23), tp_size=2)
OLD = ServerFeatures(version=(0, 5, 20), tp_size=2)


def test_versions_and_feature_gates():
    assert parse_version("0.5.23") == (0, 5, 23)
    assert parse_version("0.5.21.post1") == (0, 5, 21)
    assert parse_version("v0.5.22rc1") == (0, 5, 22)
    assert parse_version("1.0") == (1, 0, 0)
    with pytest.raises(ValueError, match="cannot read an SGLang version"):
        parse_version("main")
    assert NEW.weight_update_session and NEW.selector and NEW.checker_skip_list
    assert not (OLD.weight_update_session or OLD.selector or OLD.checker_skip_list)
    assert ServerFeatures(version=(0, 5, 21)).weight_update_session


def test_features_from_server_info():
    info = {"version": "0.5.23", "tp_size": 4, "enable_memory_saver": True, "enable_return_routed_experts": True,
            "speculative_algorithm": "EAGLE", "weight_cache_mode": "off"}
    f = ServerFeatures.from_server_info(info)
    assert (f.version, f.tp_size, f.memory_saver, f.routed_experts, f.speculative_algorithm) == \
        ((0, 5, 23), 4, True, True, "EAGLE")
    f = ServerFeatures.from_server_info({"version": "0.5.16", "speculative_algorithm": None})
    assert f.tp_size == 1 and f.speculative_algorithm is None and not f.memory_saver
    with pytest.raises(ValueError, match="no 'version'"):
        ServerFeatures.from_server_info({"tp_size": 1})


def test_selector_on_new_and_old_servers():
    assert protocol.selector_fields("draft", NEW) == {"selector": "draft"}
    assert protocol.selector_fields("all", OLD) == {}
    assert protocol.selector_fields("target", OLD) == {"disable_draft_model": True}
    with pytest.raises(ValueError, match="cannot update only the draft"):
        protocol.selector_fields("draft", OLD)


def test_tensor_body_has_one_payload_per_rank_and_flushes_only_when_told():
    body = protocol.update_from_tensor_body([b"\x80a", b"\x80b"], flush_cache=False, weight_version=None,
                                            selector="all", features=NEW)
    assert body == {"serialized_named_tensors": [b"\x80a", b"\x80b"], "load_format": "flattened_bucket",
                    "flush_cache": False, "abort_all_requests": False, "selector": "all"}
    last = protocol.update_from_tensor_body([b"a", b"b"], flush_cache=True, weight_version="7", selector="all",
                                            features=OLD)
    assert last["flush_cache"] is True and last["weight_version"] == "7" and "selector" not in last
    with pytest.raises(ValueError, match="one per rank"):
        protocol.update_from_tensor_body([b"a"], flush_cache=True, weight_version=None, selector="all", features=NEW)
    # JSON transport: bytes become base64 strings, as SGLang's HTTP schema expects
    wire = json.loads(json.dumps(body, default=protocol.json_default))
    assert wire["serialized_named_tensors"] == ["gGE=", "gGI="]


def test_distributed_body():
    body = protocol.update_from_distributed_body(["w", "b"], ["bfloat16", "bfloat16"], [(2, 3), (3,)],
                                                 group_name="g", flush_cache=True, weight_version="3",
                                                 selector="target", features=OLD)
    assert body["shapes"] == [[2, 3], [3]] and body["load_format"] == "flattened_bucket"
    assert body["disable_draft_model"] is True and body["weight_version"] == "3"


def test_weights_checker_body_and_skip_lists():
    assert protocol.weights_checker_body("checksum", skip=["k_scale"], selector="all", features=NEW) == \
        {"action": "checksum", "selector": "all", "skip_tensor_list": ["k_scale"]}
    assert protocol.weights_checker_body("snapshot", skip=[], selector="all", features=OLD) == {"action": "snapshot"}
    with pytest.raises(ValueError, match="cannot skip tensors"):
        protocol.weights_checker_body("reset_tensors", skip=["k_scale"], selector="all", features=OLD)
    with pytest.raises(ValueError, match="unknown weights_checker action"):
        protocol.weights_checker_body("restore", skip=[], selector="all", features=NEW)


def test_generate_body_and_sampling_params():
    sp = protocol.sampling_params(max_new_tokens=4, temperature=0.7, top_p=1.0, top_k=0, stop_token_ids=(5, 2, 5),
                                  seed=11)
    assert sp["top_k"] == -1 and sp["stop_token_ids"] == [2, 5] and sp["sampling_seed"] == 11
    assert sp["skip_special_tokens"] is False and sp["no_stop_trim"] is True
    body = protocol.generate_body([[1, 2], [1, 2]], [sp, sp], return_routed_experts=True, processed_logprobs=True)
    assert body["return_logprob"] is True and body["stream"] is False
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
    assert body["return_sampling_mask"] is True and body["sampling_logprobs_mode"] == "selected"
    assert not protocol.truncates_distribution(1.0, -1)
    assert protocol.truncates_distribution(0.9, -1) and protocol.truncates_distribution(1.0, 20)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        protocol.generate_body([[1], [2]], [sp])


def _item(ids, logprobs, reason=None, **meta):
    return {"output_ids": ids, "meta_info": {
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
        "finish_reason": reason or {"type": "length", "length": len(ids)}, **meta}}


def test_parse_generate_item():
    out = protocol.parse_generate_item(_item([4, 9], [-0.5, -1.5], weight_version="3"), processed_logprobs=False)
    assert out.output_ids == [4, 9] and out.logprobs == [-0.5, -1.5] and out.finish_reason == "length"
    assert out.weight_version == "3" and out.weight_versions is None and out.routed_experts_b64 is None
    item = _item([4, 9], [-0.5, -1.5], {"type": "stop", "matched": 9},
                 output_token_sampling_logprobs=[-0.1, -0.2],
                 weight_versions=[{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}])
    out = protocol.parse_generate_item(item, processed_logprobs=True)
    assert out.logprobs == [-0.1, -0.2] and out.finish_reason == "stop"
    assert out.weight_versions == [("2", 0), ("3", 1)]


def test_parse_generate_item_refuses_inconsistent_answers():
    bad = _item([4, 9], [-0.5, -1.5])
    bad["meta_info"]["output_token_logprobs"][1][1] = 8
    with pytest.raises(ValueError, match="entry 1 is for token 8"):
        protocol.parse_generate_item(bad, processed_logprobs=False)
    with pytest.raises(ValueError, match="cannot report the behaviour log-probs"):
        protocol.parse_generate_item(_item([4], [-0.5]), processed_logprobs=True)
    with pytest.raises(ValueError, match="'abort'.*paused"):
        protocol.parse_generate_item(_item([4], [-0.5], {"type": "abort", "message": "paused"}),
                                     processed_logprobs=False)
    with pytest.raises(ValueError, match="no meta_info.output_token_logprobs"):
        protocol.parse_generate_item({"output_ids": [1], "meta_info": {}}, processed_logprobs=False)


def test_speculative_counters_and_acceptance_per_position():
    """No verify step (a request answered by prefill alone): no counters. A histogram that does
    not add up to the verify steps is an inconsistent answer. Acceptance per position over
    samples: position i is reached by the verify steps that accepted >= i drafts."""
    assert protocol.parse_generate_item(_item([4], [-0.5]), processed_logprobs=False).spec is None
    with pytest.raises(ValueError, match="counts 3 verify steps, spec_verify_ct 4"):
        protocol.parse_generate_item(_item([4], [-0.5], spec_verify_ct=4, spec_correct_drafts_histogram=[1, 2]),
                                     processed_logprobs=False)
    a = protocol.SpecCounts(verify_steps=4, correct_drafts=3, completion_tokens=8, histogram=[2, 1, 1])
    b = protocol.SpecCounts(verify_steps=2, correct_drafts=0, completion_tokens=3, histogram=[2])
    m = protocol.acceptance_metrics([a, b], draft_positions=2)
    assert m["rollout/spec/acceptance_pos1"] == pytest.approx(2 / 6) and m["rollout/spec/acceptance_pos2"] == pytest.approx(1 / 6)
    assert m["rollout/acceptance_d1"] == pytest.approx(2 / 6) and m["rollout/acceptance_d2"] == pytest.approx(1 / 2)
    assert m["rollout/accept_length"] == pytest.approx(11 / 6) and m["rollout/spec/acceptance_rate"] == pytest.approx(3 / 12)
    assert protocol.acceptance_metrics([], draft_positions=2) == {}


def test_answers():
    assert protocol.is_success(None) and protocol.is_success({"success": True})
    assert not protocol.is_success({"success": False, "message": "must run between begin_weight_update()"})
    assert answer_message({"error": {"message": "boom"}}) == "boom"
