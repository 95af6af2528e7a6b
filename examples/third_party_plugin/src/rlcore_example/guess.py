"""``guess``: a third-party environment. The task's answer is a secret digit; each turn the
model's first word is its guess, and the environment answers ``=`` and how far off the guess was
(``= 3``), until it is right or ``environment.max_turns`` ends the conversation. The environment
gives the reward itself: 1 for a right guess, less for each turn it took, 0 otherwise."""

from __future__ import annotations

from typing import Any

from rlcore.types import EnvStep, Turn


class GuessEnvironment:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def reset(self, prompt: Any, task_prompt: Any) -> dict[str, Any]:
        answer = str(getattr(task_prompt, "meta", {}).get("answer", "0"))
        return {"secret": int(answer) if answer.isdigit() else 0, "turns": 0, "found": False}

    def step(self, state: dict[str, Any], turn: Turn) -> EnvStep:
        state["turns"] += 1
        words = self.tokenizer.decode(turn.ids, skip_special_tokens=True).split()
        guess = int(words[0]) if words and words[0].isdigit() else None
        if guess == state["secret"]:
            state["found"] = True
            return EnvStep(done=True, reason="found")
        off = "9" if guess is None else str(min(abs(guess - state["secret"]), 9))
        return EnvStep(done=False, observation_ids=self.tokenizer(f" = {off}", add_special_tokens=False)["input_ids"])

    def final_reward(self, state: dict[str, Any]) -> float:
        return 1.0 / state["turns"] if state["found"] else 0.0
