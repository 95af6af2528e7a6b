"""The plugin module named by the entry point. It must stay cheap to import: torch is imported
by the head's factory, not here."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore import PLUGIN_API, hookimpl
from rlcore.algorithms import AlgorithmSpec
from rlcore.errors import ConfigError
from rlcore.types import Cap, EnvironmentSpec, ForwardFnSpec, PluginSettings, PostprocessResult

__all__ = ["PLUGIN_API", "algorithm", "engine", "environment", "forward_fn", "plugin_settings", "postprocess",
           "rollout_backend", "step_end"]

#: how many times the naive head ran since the last step_end (shows which head a run used)
CALLS = {"forward": 0}


@dataclass
class ExampleSettings:
    """The ``example:`` config section."""

    length_penalty: float = 0.0


@hookimpl
def plugin_settings():
    return PluginSettings(section="example", schema=ExampleSettings)


def _build_head(ctx):
    from rlcore_example.head import NaiveHead

    return NaiveHead(counter=CALLS)


@hookimpl
def forward_fn():
    yield ForwardFnSpec(
        name="example-naive",
        factory=_build_head,
        capabilities={Cap.ENTROPY, Cap.PER_TOKEN_TEMPERATURE},
        description="full-logits torch.log_softmax head (the naive baseline)",
    )


@hookimpl
def engine():
    from rlcore_example.outsider import engines

    yield from engines()


@hookimpl
def rollout_backend():
    from rlcore_example.outsider import rollout_backends

    yield from rollout_backends()


@dataclass
class ReinforceSettings:
    """``algorithm: {name: example-reinforce, baseline: mean}``; ``baseline``: ``mean`` (the
    group's mean reward) or ``none``."""

    baseline: str = "mean"


def _validate_reinforce(section) -> None:
    if section.baseline not in ("mean", "none"):
        raise ConfigError(f"bad value for config key 'algorithm.baseline': {section.baseline!r}; choose one of: mean, none",
                          key="algorithm.baseline")


def _build_reinforce(settings):
    from rlcore_example.algorithm import build

    return build(settings)


@hookimpl
def algorithm():
    yield AlgorithmSpec(
        name="example-reinforce", factory=_build_reinforce, settings=ReinforceSettings,
        validate=_validate_reinforce, loss_agg="token-mean",
        description="REINFORCE with a group-mean baseline (no ratio, no clipping)",
        source="Williams 1992, eq. 11",
    )


def _build_guess(ctx):
    from rlcore_example.guess import GuessEnvironment

    return GuessEnvironment(ctx.engine.tokenizer)


@hookimpl
def environment():
    yield EnvironmentSpec(name="guess", factory=_build_guess,
                          description="the model guesses the secret digit; told how far off, it guesses again")


@hookimpl
def postprocess(ctx, output):
    mask = ctx.batch.loss_mask
    metrics = {"example/response_tokens": float(mask.sum()) / max(ctx.batch.num_seqs, 1)}
    loss_terms = {}
    penalty = float(ctx.config.example.length_penalty) if ctx.config is not None else 0.0
    if ctx.phase == "train" and penalty:
        # a (differentiable) nudge towards shorter answers: penalise log-prob mass on long tails
        lp = output.head.logprobs
        loss_terms["length_penalty"] = penalty * (lp.exp() * mask).sum() / max(ctx.num_tokens_in_step, 1)
    return PostprocessResult(loss_terms=loss_terms, metrics=metrics)


@hookimpl
def step_end(ctx):
    calls, CALLS["forward"] = CALLS["forward"], 0
    return {"example/forward_calls": float(calls)}
