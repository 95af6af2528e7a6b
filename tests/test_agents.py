"""examples/tiny_tools.yaml learns on a CPU (issue 29): the tiny model learns to call the
calculator and copy its answer, trained on its own tokens only (the observation masked out), with
the behaviour log-probs of those tokens equal to the trainer's recomputation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rlcore.stack import load_stack
from rlcore.testing.runs import Trainer

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_tools_learns_to_call_the_calculator(tmp_path):
    out = tmp_path / "run"
    stack = load_stack(str(ROOT / "examples" / "tiny_tools.yaml"),
                       ["training.steps=25", f"output.dir={out}", "output.checkpoint_every=0", "output.plot=false"])
    assert Trainer(stack).run()["completed"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    outcome = [r["reward_mean"] - r["env/turn_reward_mean"] for r in rows]  # the answer's reward, without the bonus
    first, last = sum(outcome[:3]) / 3, sum(outcome[-5:]) / 5
    print(f"\n[figure] tiny_tools: answer reward {first:.2f} (first 3 steps) -> {last:.2f} (last 5), "
          f"calc calls {rows[0]['env/tool_calls/calc']:.0f} -> {rows[-1]['env/tool_calls/calc']:.0f} of 128")
    assert first < 0.3 and last > 0.8
    for r in rows:
        # two turns of one token and one observation of two ("result 56"): observed tokens are never trained
        assert r["env/tokens_trained"] + r["env/tokens_observed"] == r["response_len"] * r["samples"]
        assert r["logprob_mismatch_max"] < 1e-4, "the rollout's log-probs of the model's tokens are the trainer's"
    assert rows[-1]["env/turns_mean"] > 1.8 and rows[-1]["env/tool_failures/calc"] == 0
    assert rows[-1]["env/end/answered"] > 0.9


@pytest.mark.parametrize("algorithm", ["rloo", "dr_grpo", "reinforce_pp", "gspo"])
def test_other_estimators_train_on_conversations(tmp_path, algorithm):
    """Group and token-level estimators work over whole conversations, on the masked tokens (the
    trainer checks every advantage tensor against the loss tokens of its sample)."""
    out = tmp_path / "run"
    stack = load_stack(str(ROOT / "examples" / "tiny_tools.yaml"),
                       ["plugins=[algorithms]", f"algorithm.name={algorithm}", "training.steps=2", f"output.dir={out}",
                        "output.checkpoint_every=0", "output.plot=false", "data.prompts_per_step=4"])
    assert Trainer(stack).run()["completed"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["env/tokens_trained"] > 0 for r in rows)


def test_turn_rewards_reach_a_token_level_estimator_on_their_turns(tmp_path, rlcore_plugin_manager, register_plugin):
    """The tools environment's per-turn reward (``tool_call_reward`` for a call that succeeds) is
    on the calling turn's last trained token in the token rewards an estimator that takes them
    receives, not folded into the sample's last token; each sample's token rewards still sum to its
    reward."""
    import types

    from rlcore.algorithms import PPOClip
    from rlcore.algorithms import advantages as adv
    from rlcore.hookspecs import hookimpl
    from rlcore.stack import load_config, resolve
    from rlcore.types import Algorithm, AlgorithmSpec

    seen = []

    class Recording(adv.DrGRPOAdvantage):
        def __call__(self, inp):
            seen.append(([t.clone() for t in inp.token_rewards], inp.rewards.clone()))
            return super().__call__(inp)

    mod = types.ModuleType("turnrec")
    mod.PLUGIN_API = 1
    mod.algorithm = hookimpl(lambda: [AlgorithmSpec(
        name="turn-recorder", loss_agg="token-sum",
        factory=lambda s: Algorithm(advantages=Recording(), loss=PPOClip(), token_level_rewards=True))])
    register_plugin(mod, "turnrec")
    cfg, pm = load_config(str(ROOT / "examples" / "tiny_tools.yaml"),
                          ["algorithm.name=turn-recorder", "training.steps=1", f"output.dir={tmp_path / 'run'}",
                           "output.checkpoint_every=0", "output.plot=false", "data.prompts_per_step=4"],
                          plugins=rlcore_plugin_manager)
    assert Trainer(resolve(cfg, pm)).run()["completed"]
    (token_rewards, rewards), = seen
    bonus = float(cfg.environment.tool_call_reward)
    interior = 0
    for tr, r in zip(token_rewards, rewards.tolist(), strict=True):
        assert math.isclose(float(tr.sum()), r, abs_tol=1e-6)
        interior += int(tr.numel() > 1 and math.isclose(float(tr[:-1].sum()), bonus, abs_tol=1e-6))
    assert interior > 0, "no sample had its tool-call bonus on the calling turn"
