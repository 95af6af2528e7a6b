"""The plugin module named by the entry point ``replay = "rlcore_replay.plugin"``.

It registers the ``replay:`` config section, the constraints replay needs, and the chain hooks
(``forward_request``, ``router_hook``, ``postprocess``, ``step_end``) that drive one
:class:`rlcore_replay.replay.Replayer` per run. It stays cheap to import: torch is imported by
:mod:`rlcore_replay.replay` only when a hook first runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore import PLUGIN_API, hookimpl
from rlcore.errors import ConfigError
from rlcore.types import Cap, PluginSettings, RequiresCapability

__all__ = ["PLUGIN_API", "ReplaySettings", "plugin_settings", "constraints", "forward_request", "router_hook",
           "postprocess", "step_end", "check_run_config"]

MODES = ("R2", "R3")
ON_MISSING = ("error", "native")
MTP = ("replay", "native")


@dataclass
class ReplaySettings:
    """The ``replay:`` config section.

    * ``mode``: ``R2`` records the routes of the old-log-prob pass and replays them in every
      update micro-batch; ``R3`` replays the routes the rollout engine chose in the old-log-prob
      pass and in the update. The reference (KL) pass always routes natively.
    * ``on_missing``: ``error`` (default): a sample without routes, or a router without rows, is
      an error naming it; ``native``: such tokens route natively and are counted
      (``replay/missing_samples``, ``replay/coverage``).
    * ``mtp``: ``replay`` (default): MTP routers replay their own rows (never a decoder layer's);
      ``native``: MTP routers route natively.
    * ``agreement``: also compute the router's native top-k and report the fraction of tokens
      whose native experts equal the replayed ones (``replay/agreement``, per layer and mean).
    * ``mismatch_off``: R3 only. Also run every old-log-prob micro-batch once more with native
      routing (one extra forward + head, no gradient) and report the train-vs-rollout log-prob
      mismatch with replay off next to the one with replay on
      (``replay/logprob_mismatch_{off,on}_{mean,max}``): the number replay exists to shrink.
    """

    mode: str = "R3"
    on_missing: str = "error"
    mtp: str = "replay"
    agreement: bool = False
    mismatch_off: bool = False


def validate(section: Any) -> None:
    mode = str(section.mode).strip().upper().replace(" ", "")
    if mode not in MODES:
        if "R2" in mode and "R3" in mode:
            raise ConfigError(
                f"replay.mode {section.mode!r}: R2 and R3 cannot be combined. R3 already replays the rollout "
                "engine's routes in the old-log-prob pass and the update; R2 would replace them with the "
                "trainer's own. Pick one", key="replay.mode")
        raise ConfigError(f"replay.mode must be one of {', '.join(MODES)}, got {section.mode!r}", key="replay.mode")
    section.mode = mode
    for key, allowed in (("on_missing", ON_MISSING), ("mtp", MTP)):
        if str(section[key]) not in allowed:
            raise ConfigError(f"replay.{key} must be one of {', '.join(allowed)}, got {section[key]!r}",
                              key=f"replay.{key}")


def check_run_config(cfg: Any) -> bool:
    """Cross-section checks (they need the whole config, which constraint predicates receive);
    raises :class:`ConfigError` naming the key. Returns True so that it can be a ``when``."""
    r = cfg.replay
    if r.mode == "R3" and not bool(cfg.rollout.return_routed_experts):
        raise ConfigError(
            "replay.mode R3 replays the experts the rollout engine chose, so it needs them: set "
            "rollout.return_routed_experts: true (or use replay.mode: R2)", key="rollout.return_routed_experts")
    if r.mode == "R2" and str(cfg.algorithm.old_logprobs) != "recompute":
        raise ConfigError(
            "replay.mode R2 replays the routes of the old-log-prob pass, so that the recomputed log-probs "
            "(the ratio's denominator) and the update route alike; algorithm.old_logprobs is "
            f"{cfg.algorithm.old_logprobs!r}, so the denominator would come from the rollout engine, whose "
            "routes R2 never sees: set algorithm.old_logprobs: recompute, or use replay.mode: R3",
            key="algorithm.old_logprobs")
    if r.mode == "R2" and bool(r.get("mismatch_off", False)):
        raise ConfigError(
            "replay.mismatch_off compares the old-log-prob pass with and without the rollout engine's routes, "
            "which only R3 replays there: under R2 that pass routes natively, so core's logprob_mismatch_mean/_max "
            "already is the replay-off figure (and R2's replayed update reproduces it). Use replay.mode: R3 or "
            "drop replay.mismatch_off", key="replay.mismatch_off")
    # what a rollout engine cannot return alongside its own features (SGLang's routes under speculative
    # decoding) is that engine's plugin's check of rollout.return_routed_experts, which R3 sets
    return True


@hookimpl
def plugin_settings():
    return PluginSettings(section="replay", schema=ReplaySettings, validate=validate)


@hookimpl
def constraints():
    yield RequiresCapability(role="engine", capability=Cap.ROUTER_HOOK,
                             reason="replay chooses the experts inside every MoE router", when=check_run_config)
    yield RequiresCapability(role="engine", capability=Cap.RECORD_ROUTES,
                             reason="replay.mode R2 records the routes of the old-log-prob pass",
                             when=lambda cfg: cfg.replay.mode == "R2")
    yield RequiresCapability(role="rollout_backend", capability=Cap.ROUTED_EXPERTS,
                             reason="replay.mode R3 replays the experts the rollout engine chose",
                             when=lambda cfg: cfg.replay.mode == "R3")


_REPLAYER: Any = None


def replayer(config: Any) -> Any:
    """The run's :class:`~rlcore_replay.replay.Replayer` (a new one for a new run config)."""
    global _REPLAYER
    if _REPLAYER is None or _REPLAYER.config is not config:
        from rlcore_replay.replay import Replayer

        _REPLAYER = Replayer(config)
    return _REPLAYER


@hookimpl
def forward_request(ctx):
    return replayer(ctx.config).forward_request(ctx)


@hookimpl
def router_hook(call):
    mb = call.micro_batch
    if mb is None or mb.config is None:
        return None
    return replayer(mb.config).router_hook(call)


@hookimpl
def postprocess(ctx, output):
    return replayer(ctx.config).postprocess(ctx, output)


@hookimpl
def step_end(ctx):
    return replayer(ctx.config).step_end(ctx)
