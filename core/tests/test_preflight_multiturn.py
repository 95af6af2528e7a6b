"""``rlcore check`` with a multi-turn environment (examples/tiny_tools.yaml: ``environment: tools``)
measures the longest conversation, not one turn, against the model's 512 positions: the prompt,
``environment.max_turns`` turns of ``rollout.max_new_tokens`` and an observation of up to
``environment.observation_tokens`` between turns, capped by ``environment.max_total_tokens``; a
refusal names the key to lower."""

from __future__ import annotations

import pytest
from rlcore.cli import main

TOOLS = "examples/tiny_tools.yaml"  # longest prompt 4 tokens, max_turns 2, observation_tokens 8, max_total_tokens 16


REFUSED = [
    # every turn fits alone; 100 turns and their observations do not (4 + 100 x 1 + 99 x 8 = 896)
    (["environment.max_total_tokens=0", "environment.max_turns=100"], "environment.max_turns", "= 896 tokens"),
    # the observations make it: 4 + 3 x 1 + 2 x 300 = 607
    (["environment.max_total_tokens=0", "environment.max_turns=3", "environment.observation_tokens=300"],
     "environment.max_turns", "= 607 tokens"),
    # the cap itself is past the context, and the turns reach it (4 + 2 x 300 + 8 = 612 > 600)
    (["environment.max_total_tokens=600", "rollout.max_new_tokens=300"], "environment.max_total_tokens",
     "capped by environment.max_total_tokens 600 = 600 tokens"),
    # no cap, and one turn is already too long
    (["environment.max_total_tokens=0", "rollout.max_new_tokens=600"], "rollout.max_new_tokens", "one turn already"),
]


@pytest.mark.parametrize("overrides,key,says", REFUSED, ids=[" ".join(c[0]) for c in REFUSED])
def test_the_longest_conversation_is_refused_naming_the_key(check_refusal, overrides, key, says):
    line = check_refusal(TOOLS, *overrides)
    assert f"rlcore: error: {key}:" in line and says in line and "512 positions" in line, line


def test_a_turn_longer_than_the_context_passes_when_max_total_tokens_caps_the_conversation(capsys):
    """The conversation loop cuts each turn to what fits max_total_tokens (16 here), so 600 new
    tokens per turn never reach the model's 512 positions."""
    assert main(["check", TOOLS, "rollout.max_new_tokens=600"]) == 0
    out = capsys.readouterr().out
    assert "capped by environment.max_total_tokens 16 = 16 <= 512 positions" in out, out


def test_check_reports_the_conversation_it_measured(capsys):
    assert main(["check", TOOLS]) == 0
    out = capsys.readouterr().out
    assert ("longest prompt 4 + environment.max_turns 2 x rollout.max_new_tokens 1 + 1 x "
            "environment.observation_tokens 8 = 14 <= 512 positions") in out, out
