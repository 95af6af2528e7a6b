"""The conversation loop core runs around an ``environment`` provider: token in, token out.

Turn 0 is exactly the single-turn rollout: ``backend.generate(prompts, params)``, ``params.n``
samples per prompt, the step's sampling seed. After each turn the environment answers
(:meth:`rlcore.types.Environment.step`); a conversation that goes on gets the observation's ids
appended, and its next turn's prompt is the conversation's ids so far: the prompt, every id the
engine generated, every observation id, exactly (sent to ``generate`` as token ids; nothing is
decoded and re-encoded). Turn ``k`` samples with seed ``params.seed + k * TURN_STRIDE``;
conversations whose ids are equal so far go in as one prompt with ``n`` samples (:func:`_calls`),
every other conversation as a prompt of its own.

Limits (``environment:``) end a conversation with the reason recorded in
``Sample.extras["end_reason"]``: ``max_turns`` (the environment wanted another turn after the
last allowed one), ``max_tool_calls`` (a turn's calls took the conversation past the limit; the
observation is not inserted), ``max_total_tokens`` (the observation and one more token would not
fit; each turn's ``max_new_tokens`` is also cut to what fits). An environment that answers
``done`` ends it with its own ``reason`` (default ``done``).

The finished conversation is one :class:`~rlcore.types.Sample`: ``response_ids`` every turn and
observation in order, ``response_mask`` true on the engine's tokens (trained) and false on the
observations' (not trained), ``logprobs`` the behaviour log-probs of the engine's tokens (0 on
observations), ``routed_experts`` the rows the engine reported when it produced each token, and in
``extras``: ``turns``, ``tool_calls`` (:class:`~rlcore.types.ToolCall` list), ``end_reason``,
``turn_rewards`` (``(response index of the turn's last token, reward)`` per rewarded turn) and
``final_reward`` (the environment's, or ``None``: ``data.reward`` scores it). A conversation of
one turn is the engine's sample itself (``response_mask`` ``None``: every token trained).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rlcore.errors import RLCoreError, RolloutError, one_line
from rlcore.types import EnvStep, Prompt, Sample, SamplingSettings, ToolCall, Turn

#: what separates the turns of one round in the sampling seed (below ``ROUND_STRIDE`` = 2**53 for
#: any turn count a config can ask: max_turns < 256)
TURN_STRIDE = 1 << 45


class NamedEnvironment:
    """An environment provider's object with where it comes from: a ``reset``, ``step`` or
    ``final_reward`` that raises is one :class:`~rlcore.errors.PluginHookError` naming the plugin,
    its distribution, the environment and the method, whichever it is (the build wraps every
    environment in it: :func:`rlcore.run_build.build_run`). Everything else is the object's."""

    def __init__(self, inner: Any, plugin: str, label: str, name: str, tokenizer: Any = None,
                 multi_turn: bool = True):
        self.inner, self.plugin, self.label, self.name = inner, plugin, label, name
        #: its spec's ``multi_turn`` (:class:`~rlcore.types.EnvironmentSpec`)
        self.multi_turn = bool(multi_turn)
        #: ``<unk>`` in an observation is warned about once (:class:`~rlcore.environments.standard.UnknownWordsWarning`)
        self.unk_id = getattr(tokenizer, "unk_token_id", None)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _call(self, method: str, *args: Any) -> Any:
        from rlcore.manager import hook_error

        try:
            return getattr(self.inner, method)(*args)
        except RLCoreError:
            raise
        except Exception as exc:
            raise hook_error(self.plugin, self.label, f"environment {self.name!r}.{method}()", exc) from exc

    def reset(self, prompt: Any, task_prompt: Any) -> Any:
        return self._call("reset", prompt, task_prompt)

    def step(self, state: Any, turn: Turn) -> EnvStep:
        step = self._call("step", state, turn)
        if (self.unk_id is not None and not getattr(self.inner, "warned_unknown", False)
                and isinstance(step, EnvStep) and self.unk_id in step.observation_ids):
            from rlcore.environments.standard import warn_unknown_words

            try:  # an environment that names the words itself (the built-in tools) has warned already
                self.inner.warned_unknown = True
            except AttributeError:
                pass
            count = sum(1 for i in step.observation_ids if i == self.unk_id)
            self.unk_id = None  # once
            warn_unknown_words([f"<unk> x{max(count, 1)}"], f"environment {self.name!r} (plugin {self.plugin!r})",
                               "its observations hold words outside the tokenizer's vocabulary; with the tiny model, "
                               "add them to data.task's vocab")
        return step

    def final_reward(self, state: Any) -> float | None:
        return self._call("final_reward", state)


def _env_call(environment: Any, method: str, name: str, where: str, *args: Any) -> Any:
    """``environment.<method>(*args)``; an exception is one line naming ``name``, the method and
    ``where`` (rlcore's own errors, a :class:`NamedEnvironment`'s included, pass unchanged)."""
    try:
        return getattr(environment, method)(*args)
    except RLCoreError:
        raise
    except Exception as exc:
        raise RolloutError(f"{name}.{method}() raised {type(exc).__name__}: {one_line(exc)} {where}") from exc


@dataclass(frozen=True)
class Limits:
    """``environment:``'s limits per conversation (``max_total_tokens`` 0: none)."""

    max_turns: int
    max_total_tokens: int
    max_tool_calls: int

    @classmethod
    def from_config(cls, env: Any) -> Limits:
        return cls(int(env.max_turns), int(env.max_total_tokens), int(env.max_tool_calls))


@dataclass
class _Conversation:
    prompt: Prompt
    first: Sample
    state: Any
    ids: list[int]
    turns: list[Sample] = field(default_factory=list)
    #: the response so far: ids, trained or not, behaviour log-probs
    response: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    end_reason: str = ""

    def add_turn(self, s: Sample) -> None:
        ids = s.response_ids.tolist()
        self.turns.append(s)
        self.ids += ids
        self.response += ids
        self.mask += [True] * len(ids)
        self.logprobs += s.logprobs.float().tolist()

    def budget(self, max_new_tokens: int, limits: Limits) -> int:
        if not limits.max_total_tokens:
            return max_new_tokens
        return min(max_new_tokens, limits.max_total_tokens - len(self.ids))


def run_conversations(environment: Any, backend: Any, prompts: Sequence[Prompt], task_prompts: Sequence[Any],
                      params: SamplingSettings, limits: Limits, name: str = "environment") -> list[Sample]:
    """``params.n`` conversations per prompt, one sample each, ordered as ``generate`` orders
    them (see the module docstring). ``name`` names the environment in errors."""
    by_index = {p.index: p for p in prompts}
    first_params = params
    if limits.max_total_tokens:
        longest = max((len(p.ids) for p in prompts), default=0)
        first_params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens,
                                                                limits.max_total_tokens - longest)))
    convs = []
    for s in backend.generate(prompts, first_params):
        prompt = by_index[s.prompt_index]
        state = _env_call(environment, "reset", name, f"for prompt {s.prompt_index}", prompt,
                          task_prompts[s.prompt_index])
        c = _Conversation(prompt, s, state, list(s.prompt_ids))
        c.add_turn(s)
        convs.append(c)
    active = list(convs)
    turn = 0
    while active:
        active = [c for c in active if _answer(environment, c, turn, limits, name, len(convs))]
        turn += 1
        seed = None if params.seed is None else params.seed + turn * TURN_STRIDE
        for (budget, n), contexts in _calls(active, params.max_new_tokens, limits):
            asks = [Prompt(ids=list(convs[0].ids), index=i, meta=convs[0].prompt.meta)
                    for i, convs in enumerate(contexts)]
            got = backend.generate(asks, replace(params, n=n, max_new_tokens=budget, seed=seed))
            group = [c for convs in contexts for c in convs]  # generate's order: by prompt, then sample
            if len(got) != len(group):
                raise RolloutError(f"rollout returned {len(got)} samples for {len(group)} conversations in turn {turn}")
            for c, s in zip(group, got, strict=True):
                c.add_turn(s)
    return [_sample(c, _env_call(environment, "final_reward", name, f"for a conversation of prompt {c.first.prompt_index}",
                                 c.state)) for c in convs]


def _calls(active: list[_Conversation], max_new_tokens: int,
           limits: Limits) -> list[tuple[tuple[int, int], list[list[_Conversation]]]]:
    """A turn's ``generate`` calls: conversations whose ids are equal so far (the samples of one
    prompt often are, after a deterministic observation) go in as one prompt with ``n`` samples:
    one prefill, and the engine's own ``n``-sampling keeps them apart whatever its seeding (a
    backend that seeded each prompt of a call alike would otherwise draw the same token for each;
    rlcore-vllm and the local backend now seed prompts apart). One call per (token budget, ``n``)."""
    contexts: dict[tuple[int, ...], list[_Conversation]] = {}
    for c in active:
        contexts.setdefault(tuple(c.ids), []).append(c)
    calls: dict[tuple[int, int], list[list[_Conversation]]] = {}
    for convs in contexts.values():
        calls.setdefault((convs[0].budget(max_new_tokens, limits), len(convs)), []).append(convs)
    return sorted(calls.items(), key=lambda kv: kv[0])


def _answer(environment: Any, c: _Conversation, turn: int, limits: Limits, name: str, total: int) -> bool:
    """The environment's answer to ``c``'s last turn; whether the conversation goes on."""
    s = c.turns[-1]
    ids = s.response_ids.tolist()
    ask = Turn(ids=ids, finish_reason=s.finish_reason, index=turn, context_ids=list(c.ids),
               tool_calls_left=max(limits.max_tool_calls - len(c.tool_calls), 0))
    try:
        step = environment.step(c.state, ask)
    except RLCoreError:
        raise
    except Exception as exc:
        raise RolloutError(f"{name} raised {type(exc).__name__}: {one_line(exc)} on turn {turn} of a conversation (an "
                           f"environment answers anything the model writes with an observation)") from exc
    if not isinstance(step, EnvStep):
        raise RolloutError(f"{name}.step returned {type(step).__name__}, expected rlcore.types.EnvStep")
    c.tool_calls += list(step.tool_calls)
    if step.reward:
        c.turn_rewards.append((len(c.response) - 1, float(step.reward)))
    if step.done:
        c.end_reason = step.reason or "done"
        return False
    obs = [int(x) for x in step.observation_ids]
    if len(c.turns) >= limits.max_turns:
        c.end_reason = "max_turns"
    elif len(c.tool_calls) > limits.max_tool_calls:
        c.end_reason = "max_tool_calls"
    elif limits.max_total_tokens and len(c.ids) + len(obs) + 1 > limits.max_total_tokens:
        c.end_reason = "max_total_tokens"
    if c.end_reason:
        return False
    c.ids += obs
    c.response += obs
    c.mask += [False] * len(obs)
    c.logprobs += [0.0] * len(obs)
    return True


def _sample(c: _Conversation, final_reward: float | None) -> Sample:
    extras = {**c.first.extras, "turns": len(c.turns), "tool_calls": c.tool_calls, "end_reason": c.end_reason,
              "turn_rewards": c.turn_rewards, "final_reward": final_reward}
    if len(c.turns) == 1:
        c.first.extras = extras  # one turn: the engine's own sample, unchanged
        return c.first
    last = c.turns[-1]
    return Sample(
        prompt_index=c.first.prompt_index, prompt_ids=list(c.first.prompt_ids),
        response_ids=torch.tensor(c.response, dtype=torch.long), logprobs=torch.tensor(c.logprobs, dtype=torch.float32),
        weight_version=min(t.weight_version for t in c.turns), finish_reason=last.finish_reason,
        routed_experts=_routes(c), weight_versions=_versions(c), extras=extras,
        response_mask=torch.tensor(c.mask, dtype=torch.bool),
    )


def _turn_spans(c: _Conversation) -> list[tuple[int, int]]:
    """Each turn's generated tokens as ``(start, end)`` positions in the whole sequence."""
    return [(len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)) for t in c.turns]


def _routes(c: _Conversation) -> torch.Tensor | None:
    """The conversation's routes: each turn's rows that produced its tokens (``start - 1`` up to
    ``end - 1``) from that turn, the rest (observations) from the last turn's prefill."""
    if any(t.routed_experts is None for t in c.turns):
        return None
    out = torch.as_tensor(c.turns[-1].routed_experts).clone()
    for t, (start, end) in zip(c.turns[:-1], _turn_spans(c)[:-1], strict=True):
        out[start - 1: end - 1] = torch.as_tensor(t.routed_experts)[start - 1: end - 1]
    return out


def _versions(c: _Conversation) -> tuple[tuple[int, int], ...] | None:
    """``((version, first response index), ...)`` when the turns (or tokens within one) came from
    different weight versions, else ``None``."""
    P = len(c.first.prompt_ids)
    marks: list[tuple[int, int]] = []
    for t, (start, _end) in zip(c.turns, _turn_spans(c), strict=True):
        for version, first in t.weight_versions or ((t.weight_version, 0),):
            if not marks or marks[-1][0] != version:
                marks.append((int(version), start - P + int(first)))
    return tuple(marks) if len(marks) > 1 else None


def trained_lengths(samples: Sequence[Sample]) -> list[int]:
    """The tokens of each sample's response that are trained (the engine's; not observations)."""
    return [len(s.response_ids) if s.response_mask is None else int(s.response_mask.sum()) for s in samples]


def turn_token_rewards(samples: Sequence[Sample], rewards: Sequence[float]) -> list[torch.Tensor]:
    """Per sample, ``[n_i]`` rewards over its trained tokens, for estimators that take per-token
    rewards: each rewarded turn's reward on that turn's last token, the rest of the sample's
    reward (its outcome) on its last trained token; each sums to the sample's reward."""
    out = []
    for s, r, n in zip(samples, rewards, trained_lengths(samples), strict=True):
        tr = torch.zeros(n)
        if n:
            mask = s.response_mask if s.response_mask is not None else torch.ones(len(s.response_ids), dtype=torch.bool)
            trained_index = torch.cumsum(mask.long(), 0) - 1  # response index -> index among trained tokens
            rest = float(r)
            for at, value in s.extras.get("turn_rewards", ()):
                tr[int(trained_index[at])] += value
                rest -= value
            tr[-1] += rest
        out.append(tr)
    return out


def place_turn_rewards(token_rewards: list[torch.Tensor], samples: Sequence[Sample], rewards: Sequence[float]) -> None:
    """Move per-turn rewards onto their turns in ``token_rewards`` (what
    :func:`rlcore.algorithms.advantages.shaped_rewards` gives: each sample's whole reward on its
    last loss token, plus any per-token KL penalty), in place: the turn rewards go to their turns'
    last tokens (:func:`turn_token_rewards`), the sum per sample unchanged. A sample without turn
    rewards, or out of the loss (overlong filtering: no loss tokens), is left as it is."""
    placed = turn_token_rewards(samples, rewards)
    for tr, s, r, p in zip(token_rewards, samples, rewards, placed, strict=True):
        if s.extras.get("turn_rewards") and tr.numel() and tr.numel() == p.numel():
            tr[-1] -= float(r)
            tr += p


def conversation_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Turns per sample, tool calls and failures per tool, end reasons, tokens trained and observed."""
    n = max(len(samples), 1)
    turns = [int(s.extras.get("turns", 1)) for s in samples]
    trained = trained_lengths(samples)
    m: dict[str, float] = {"env/turns_mean": sum(turns) / n, "env/turns_max": float(max(turns, default=0)),
                           "env/tokens_trained": float(sum(trained)),
                           "env/tokens_observed": float(sum(len(s.response_ids) for s in samples) - sum(trained)),
                           "env/turn_reward_mean": sum(v for s in samples for _, v in s.extras.get("turn_rewards", ()))
                           / n}
    calls: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    for s in samples:
        for call in s.extras.get("tool_calls", ()):
            calls[call.tool] += 1
            failures[call.tool] += not call.ok
    for tool in sorted(calls):
        m[f"env/tool_calls/{tool}"] = float(calls[tool])
        m[f"env/tool_failures/{tool}"] = float(failures[tool])
    for reason, count in sorted(Counter(str(s.extras.get("end_reason", "")) for s in samples).items()):
        m[f"env/end/{reason or 'done'}"] = count / n
    return m
