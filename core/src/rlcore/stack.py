"""Resolving a config into a stack: which plugin provides each role, in which chain order, and
whether the combination is allowed. ``rlcore check`` prints this; ``rlcore train`` builds it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlcore import config as cfgmod
from rlcore import errors
from rlcore.hookspecs import CHAIN_HOOKS, ROLES
from rlcore.inactive_plugins import require_active_algorithm
from rlcore.manager import PluginManager
from rlcore.tracking.selection import select_trackers
from rlcore.types import (
    Cap,
    EngineSpec,
    ForwardFnSpec,
    IncompatibleWith,
    LauncherSpec,
    RequiresCapability,
    RolloutBackendSpec,
    TrackerSpec,
    WeightSyncSpec,
)

__all__ = ["ONE_ROLES", "check_engine_head", "config_yaml", "load_config", "load_stack", "resolve"]

#: the roles that select one provider, in the table's order (each a field of :class:`Stack`)
ONE_ROLES = tuple(hook for hook, role in ROLES.items() if role.selects == "one")


@dataclass
class Stack:
    """A validated config and the providers it selects."""

    config: DictConfig
    plugins: PluginManager
    engine: EngineSpec
    forward_fn: ForwardFnSpec
    rollout_backend: RolloutBackendSpec
    weight_sync: WeightSyncSpec
    chains: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: per role, declared capabilities unavailable here, with reasons
    gaps: dict[str, dict[str, str]] = field(default_factory=dict)
    #: per role, the capabilities this config uses, with why: only a gap in one of them is a note
    #: (a required one is an error); any other gap is no news to the user (``rlcore check --json``)
    wanted: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the selected algorithm (``algorithm.name``)
    algorithm: Any = None
    #: the device platform ``engine.device`` selects (a :class:`~rlcore.types.PlatformSpec`)
    platform: Any = None
    #: where the ranks and replicas run (``cluster.backend``)
    launcher: LauncherSpec | None = None
    #: what takes the model's turns (``environment.name``; an :class:`~rlcore.types.EnvironmentSpec`)
    environment: Any = None
    #: the tools the environment calls, when its spec ``uses_tools`` (``environment.tools``, in order;
    #: :class:`~rlcore.types.ToolSpec`)
    tools: list[Any] = field(default_factory=list)
    #: the experiment trackers (``tracking.backends``, and tensorboard by ``output.tensorboard``;
    #: :class:`~rlcore.types.TrackerSpec`, in order)
    trackers: list[TrackerSpec] = field(default_factory=list)

    def has(self, role: str, cap: str) -> bool:
        """Declared by the selected provider and available on this platform."""
        return cap in self.role(role).capabilities and cap not in self.gaps.get(role, {})

    def role(self, role: str):
        """The provider selected for ``role``: a provider hook that selects one (a row of
        :data:`rlcore.hookspecs.ROLES`; the field of this name)."""
        if role not in ONE_ROLES:
            raise ValueError(f"{role!r} is not a role that selects one provider; roles: {', '.join(ONE_ROLES)}")
        return getattr(self, role)

    def describe(self) -> dict[str, Any]:
        def spec(s):
            return {"name": s.name, "plugin": s.plugin, "distribution": s.distribution,
                    "capabilities": sorted(s.capabilities)}

        return {
            "plugins": [
                {"name": n, "distribution": self.plugins.plugin_label(n)} for n in self.plugins.active
            ],
            "engine": spec(self.engine),
            "forward_fn": spec(self.forward_fn),
            "rollout_backend": spec(self.rollout_backend),
            "weight_sync": spec(self.weight_sync),
            "algorithm": (None if self.algorithm is None else
                          {"name": self.algorithm.name, "plugin": self.algorithm.plugin,
                           "distribution": self.algorithm.distribution, "source": self.algorithm.source,
                           "loss_agg": self.config.algorithm.loss_agg}),
            "platform": (None if self.platform is None else
                         {**spec(self.platform), "device": str(self.config.engine.device),
                          "dist_backend": self.platform.dist_backend}),
            "launcher": (None if self.launcher is None else
                         {**spec(self.launcher), "describe": self.launcher.factory(self.config).describe(self)}),
            "environment": None if self.environment is None else spec(self.environment),
            "tools": [spec(t) for t in self.tools],
            "trackers": [spec(t) for t in self.trackers],
            "chains": self.chains,
            "notes": self.notes,
            "gaps": self.gaps,
        }


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    plugins: PluginManager | None = None,
) -> tuple[DictConfig, PluginManager]:
    """Read, activate the plugins the config names, and validate against the full schema."""
    raw = cfgmod.read_raw(path, overrides)
    names = PluginManager.requested_plugins(cfgmod.raw_plugins(raw))
    pm = plugins or PluginManager()
    pm.activate(names, source=PluginManager.plugin_list_source())
    settings = pm.plugin_settings()
    require_active_algorithm(raw, pm)
    cfg = cfgmod.validate(raw, settings, known_plugin_sections=_known_sections(pm), algorithms=pm.algorithms(),
                         environments=pm.environments(), launchers=pm.launchers())
    cfg.plugins = names
    return cfg, pm


def _known_sections(pm: PluginManager) -> dict[str, str]:
    # sections of installed-but-inactive plugins, for the "add it to plugins:" hint
    out: dict[str, str] = {}
    try:
        for rec in pm.describe():
            for section in rec.provides.get("config_section", []):
                out.setdefault(section, rec.name)
    except Exception:  # noqa: BLE001 - hint only
        pass
    return out


def resolve(cfg: DictConfig, pm: PluginManager) -> Stack:
    """Select the providers and check every declared constraint and capability."""
    # every role the table gives a key of one name: the provider that name selects
    selected = {hook: pm.select(hook, str(OmegaConf.select(cfg, role.key)), key=role.key)
                for hook, role in ROLES.items() if role.selects == "one" and role.key is not None}
    stack = Stack(cfg, pm, **selected)  # type: ignore[arg-type]  (each role's field has the hook's name)
    rollout, sync = stack.rollout_backend, stack.weight_sync
    from rlcore.platforms import select_platform

    stack.platform = select_platform(cfg.engine.device, pm.platforms(), select=pm.select)  # by engine.device
    stack.chains = {hook: pm.implementers(hook) for hook in CHAIN_HOOKS}

    # the weight sync must be able to feed the backend
    if sync.backends is not None and rollout.name not in sync.backends:
        raise errors.IncompatiblePluginsError(
            f"sync.name {sync.name!r} ({sync.distribution}) feeds only rollout backends "
            f"{', '.join(sorted(sync.backends))}, but rollout.backend is {rollout.name!r} ({rollout.distribution})"
        )

    # capabilities the providers declare but cannot deliver on this machine / with this config
    for role in ONE_ROLES:
        spec = stack.role(role)
        try:
            gaps = spec.gaps(cfg)
        except Exception as exc:  # noqa: BLE001 - a broken probe must not hide the stack
            stack.notes.append(f"{role} {spec.name!r}: could not probe platform capabilities ({exc})")
            continue
        stack.gaps[role] = gaps

    for cap in sorted(sync.requires_backend):
        _require(stack, "rollout_backend", cap, f"sync.name {sync.name!r} ({sync.distribution}) pushes through it", "core")

    # core features and the capabilities they need
    if cfg.rollout.return_routed_experts:
        _require(stack, "rollout_backend", Cap.ROUTED_EXPERTS, "rollout.return_routed_experts is set", "core")
    if cfg.rollout.release_kv_cache == "always":
        _require(stack, "rollout_backend", Cap.RELEASE_KV_CACHE, "rollout.release_kv_cache is 'always'", "core")
    elif cfg.rollout.release_kv_cache == "auto":
        _want(stack, "rollout_backend", Cap.RELEASE_KV_CACHE, "rollout.release_kv_cache is 'auto'")
        if not stack.has("rollout_backend", Cap.RELEASE_KV_CACHE):
            stack.notes.append(
                f"rollout backend {rollout.name!r} cannot release its KV cache: it stays resident during weight sync"
            )
    if cfg.rollout.draft_depths:
        _want(stack, "rollout_backend", Cap.SPECULATIVE, f"rollout.draft_depths={cfg.rollout.draft_depths}")
    if float(cfg.algorithm.entropy_coef) != 0:
        _require(stack, "forward_fn", Cap.ENTROPY,
                 f"algorithm.entropy_coef={float(cfg.algorithm.entropy_coef):g} adds an entropy term to the loss", "core")
    for cap in sorted(stack.algorithm.head_needs):  # e.g. Σπ² for the optimal-token baseline
        _require(stack, "forward_fn", cap, f"algorithm.name={cfg.algorithm.name} needs it", "core")
    if stack.chains.get("router_hook"):
        _require(stack, "engine", Cap.ROUTER_HOOK,
                 f"plugin(s) {', '.join(stack.chains['router_hook'])} implement router_hook", "core")
    if cfg.sync.verify and Cap.VERIFIED not in sync.capabilities:
        raise errors.MissingCapabilityError(
            f"sync.verify is true but sync.name {sync.name!r} ({sync.distribution}) cannot verify a "
            f"push; pick a verified sync or set sync.verify=false explicitly"
        )

    # plugin-declared constraints
    active = set(pm.active)
    for owner, c in pm.constraints():
        if isinstance(c, IncompatibleWith):
            other = c.plugin.lower()
            if other in active:
                raise errors.IncompatiblePluginsError(
                    f"Plugin {owner!r} ({pm.plugin_label(owner)}) cannot be used together with "
                    f"plugin {other!r} ({pm.plugin_label(other)}): {c.reason}"
                )
        elif isinstance(c, RequiresCapability):
            if c.when is not None and not c.when(cfg):
                continue
            _require(stack, c.role, c.capability, c.reason(cfg) if callable(c.reason) else c.reason, owner)
    for role, gaps in stack.gaps.items():
        for cap, reason in sorted(gaps.items()):
            if cap in stack.wanted.get(role, {}):
                stack.notes.append(f"{role} {stack.role(role).name!r} lacks {cap!r} here: {reason}")

    if stack.environment.uses_tools:  # each a tool provider; one no active plugin has names its plugin
        stack.tools = pm.select_all("tool", list(cfg.environment.tools), key="environment.tools")
    stack.trackers, tracker_notes = select_trackers(cfg, pm)  # several at once (rlcore/tracking/selection.py)
    stack.notes.extend(tracker_notes)
    # where the ranks and replicas run: the launcher checks the providers' capabilities for it
    stack.launcher.factory(cfg).check(stack)
    return stack


def check_engine_head(stack: Stack, engine: Any) -> None:
    """Once the engine is built: the head it hands the forward_fn must be one the selected
    forward_fn declares it can handle. A vocab-sharded weight (``HeadWeight.vocab.group`` spans
    more than one rank) needs ``vocab_parallel``: a head without it would compute a softmax over
    its own shard of the vocabulary. (Engines that shard by config also declare it up front with
    a :class:`~rlcore.types.RequiresCapability`, so ``rlcore check`` catches it; this is the check
    for every engine.)"""
    from rlcore.distributed import group_size

    vocab = engine.head().vocab
    ranks = group_size(vocab.group)
    if ranks > 1 and not stack.has("forward_fn", Cap.VOCAB_PARALLEL):
        spec = stack.forward_fn
        raise errors.MissingCapabilityError(
            f"engine {stack.engine.name!r} ({stack.engine.distribution}) shards the LM-head vocabulary over "
            f"{ranks} tensor-parallel ranks (this rank holds ids [{vocab.start}, {vocab.end}) of "
            f"{vocab.vocab_size}), but forward_fn {spec.name!r} ({spec.distribution}) does not declare "
            f"'vocab_parallel': it would compute a softmax over its own shard. Pick a vocab-parallel head "
            f"(forward.name=reference or fused) or run without tensor parallelism"
        )


def _want(stack: Stack, role: str, cap: str, reason: str) -> None:
    stack.wanted.setdefault(role, {}).setdefault(cap, reason)


def _require(stack: Stack, role: str, cap: str, reason: str, owner: str) -> None:
    _want(stack, role, cap, reason)
    spec = stack.role(role)
    if stack.has(role, cap):
        return
    who = "core" if owner == "core" else f"plugin {owner!r} ({stack.plugins.plugin_label(owner)})"
    gap = stack.gaps.get(role, {}).get(cap)
    if gap is not None:
        raise errors.MissingCapabilityError(
            f"{who} needs {role} with capability {cap!r} ({reason}); the selected {role} {spec.name!r} "
            f"({spec.distribution}) declares it but cannot provide it here: {gap}"
        )
    raise errors.MissingCapabilityError(
        f"{who} needs {role} with capability {cap!r} ({reason}), but the selected {role} "
        f"{spec.name!r} ({spec.distribution}) declares: {', '.join(sorted(spec.capabilities)) or 'nothing'}"
    )


def load_stack(path: str | Path | None, overrides: Sequence[str] = ()) -> Stack:
    cfg, pm = load_config(path, overrides)
    return resolve(cfg, pm)


def config_yaml(stack: Stack) -> str:
    return OmegaConf.to_yaml(stack.config)
