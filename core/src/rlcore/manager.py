"""The plugin manager: activation, conflicts, and a typed facade over pluggy.

Only this module touches ``pluggy.PluginManager.hook``. Everything else in core calls the typed
methods of :class:`PluginManager` (``forward_fns()``, ``postprocess(...)``, ...), the way tox 4
wraps its hooks.

Plugins are found through the entry-point group ``rlcore`` (:mod:`rlcore.discovery`); the
entry-point name is the name used in config. Only the plugins the config lists (or
``RLCORE_PLUGINS`` names) are imported and registered, in that order, after core's own
built-ins, which are entry points of the ``rlcore`` distribution registered exactly like
external ones. ``rlcore plugins`` is :meth:`PluginManager.describe` (:mod:`rlcore.listing`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Iterable, Sequence
from typing import Any

import pluggy

from rlcore import errors
from rlcore.discovery import (
    ENV_DISABLED,
    ENV_PLUGINS,
    KNOWN_DISTRIBUTIONS,
    InstalledPlugin,
    LoadedPlugin,
    core_entry_points,
    core_version,
    discover_entry_points,
    first_party_plugin_of,
    install_hint,
    parse_plugin_list,
    plugin_api_of,
)
from rlcore.hookspecs import ALL_HOOKS, CHAIN_HOOKS, DESCRIPTORS, PROJECT, PROVIDER_HOOKS, RLCoreSpecs
from rlcore.inactive_plugins import activation_hint, inactive_provider
from rlcore.listing import PluginRecord, describe_plugins
from rlcore.types import (
    PLUGIN_API,
    AlgorithmSpec,
    Cap,
    EngineSpec,
    EnvironmentSpec,
    ForwardFnSpec,
    ForwardRequest,
    IncompatibleWith,
    LauncherSpec,
    PlatformSpec,
    PluginSettings,
    PostprocessResult,
    ProviderSpec,
    RequiresCapability,
    RolloutBackendSpec,
    RouterDecision,
    ToolSpec,
    TrackerSpec,
    WeightSyncSpec,
)

__all__ = ["PluginManager", "call_hook", "hook_error", "load_plugin_manager"]


class PluginManager:
    """The typed facade over pluggy that the rest of core uses.

    :param autoload: discover entry points (``False`` gives a bare manager for tests; register
        plugins with :meth:`register`).
    """

    def __init__(self, *, autoload: bool = True):
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(RLCoreSpecs)
        self._autoload = autoload
        self._installed: dict[str, list[InstalledPlugin]] | None = None
        self._loaded: dict[str, LoadedPlugin] = {}
        self._order: list[str] = []  # config order of non-builtin plugins (chain order)

    # ------------------------------------------------------------------ discovery --------

    def installed(self) -> dict[str, list[InstalledPlugin]]:
        if self._installed is None:
            self._installed = discover_entry_points() if self._autoload else {}
        return self._installed

    def builtin_names(self) -> list[str]:
        return sorted(n for n, eps in self.installed().items() if any(e.builtin for e in eps))

    def _entry_point(self, name: str, source: str | None = None) -> InstalledPlugin:
        eps = self.installed().get(name)
        if not eps:
            have = ", ".join(sorted(self.installed())) or "none"
            close = _did_you_mean(name, [*self.installed(), *KNOWN_DISTRIBUTIONS])
            if close and name not in KNOWN_DISTRIBUTIONS:
                what = f"{close} If {name!r} is a plugin of its own: {install_hint(name)}"
            else:
                what = f"Install it with: {install_hint(name)}"
            where = f"\n(the name comes from {source})" if source else ""
            raise errors.PluginNotInstalledError(
                f"Plugin {name!r} is not installed. {what}\nInstalled rlcore plugins: {have}{where}"
            )
        if len(eps) > 1:
            both = " and ".join(e.label for e in eps)
            raise errors.PluginConflictError(
                f"Plugin name {name!r} is provided by more than one distribution: {both}. "
                f"Uninstall one of them."
            )
        return eps[0]

    # ------------------------------------------------------------------ activation -------

    @staticmethod
    def requested_plugins(config_plugins: Sequence[str] | None) -> list[str]:
        """The plugin list to activate: ``RLCORE_PLUGINS`` when set (even empty), else the
        config's ``plugins:``."""
        env = os.environ.get(ENV_PLUGINS)
        if env is not None:
            return parse_plugin_list(env)
        return [str(p).strip().lower() for p in (config_plugins or [])]

    @staticmethod
    def disabled_plugins() -> set[str]:
        return set(parse_plugin_list(os.environ.get(ENV_DISABLED, "")))

    @staticmethod
    def plugin_list_source() -> str:
        """Where :meth:`requested_plugins` takes the names from, for error messages."""
        env = os.environ.get(ENV_PLUGINS)
        return f"{ENV_PLUGINS}={env}" if env is not None else "the config's plugins: list"

    def activate(self, names: Sequence[str], *, builtins: bool = True, source: str | None = None) -> None:
        """Import and register core's built-ins and then ``names`` in order. ``source`` says
        where ``names`` come from (``plugin_list_source()``), for the not-installed error.

        Raises the errors in :mod:`rlcore.errors`: not installed, import failure, API
        mismatch, invalid hook implementations, unknown hooks, provider-name conflicts.
        """
        dup = sorted({n for n in names if list(names).count(n) > 1})
        if dup:
            raise errors.ConfigError(f"plugins: {', '.join(dup)} listed more than once", key="plugins")
        disabled = self.disabled_plugins()
        for n in names:
            if n in disabled:
                raise errors.PluginError(
                    f"Plugin {n!r} is selected in the config but disabled by {ENV_DISABLED}"
                )
        if builtins:
            for n in self.builtin_names():
                if n not in self._loaded and n not in disabled:
                    self._load_entry_point(self._entry_point(n))
        for n in names:
            if n in self._loaded:
                continue
            ep = self._entry_point(n, source)
            self._load_entry_point(ep)
            if not ep.builtin:
                self._order.append(n)
        self._settle()

    def _load_entry_point(self, ep: InstalledPlugin) -> None:
        try:
            module = ep.entry_point.load()
        except Exception as exc:  # noqa: BLE001 - we re-raise with the plugin named
            raise errors.PluginImportError(
                f"Plugin {ep.name!r} ({ep.label}) failed to import {ep.value!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._register(module, ep.name, ep.distribution, ep.version, builtin=ep.builtin)

    def register(
        self,
        plugin: Any,
        name: str | None = None,
        *,
        distribution: str = "<local>",
        version: str = "0",
        builtin: bool = False,
    ) -> str:
        """Register a module or object as a plugin (tests, inline plugins). It joins the end
        of the chain order. Returns the name it was registered under."""
        name = (name or getattr(plugin, "__name__", None) or type(plugin).__name__).lower()
        self._register(plugin, name, distribution, version, builtin=builtin)
        if not builtin:
            self._order.append(name)
        self._settle()
        return name

    def unregister(self, name: str) -> None:
        loaded = self._loaded.pop(name, None)
        if loaded is None:
            return
        if self._pm.is_registered(loaded.module):
            self._pm.unregister(loaded.module)
        if name in self._order:
            self._order.remove(name)

    def load_builtins(self) -> None:
        """Register core's built-in plugins on a manager without autoload: the entry points of
        the ``rlcore`` distribution, loaded exactly as :meth:`activate` loads them."""
        for ep in core_entry_points():
            if ep.name not in self._loaded:
                self._load_entry_point(ep)

    def _register(self, module: Any, name: str, dist: str, version: str, *, builtin: bool) -> None:
        if name in self._loaded:
            other = self._loaded[name]
            raise errors.PluginConflictError(
                f"Plugin name {name!r} is registered twice: by {other.label} and by {dist} {version}"
            )
        api = plugin_api_of(module)
        label = f"{dist} {version}"
        if api is None:
            raise errors.PluginAPIError(
                f"Plugin {name!r} ({label}) does not declare PLUGIN_API; this rlcore "
                f"({core_version()}) speaks plugin API {PLUGIN_API}. Add `PLUGIN_API = "
                f"{PLUGIN_API}` to its module (from rlcore import PLUGIN_API)."
            )
        if api != PLUGIN_API:
            raise errors.PluginAPIError(
                f"Plugin {name!r} ({label}) was built for rlcore plugin API {api}, but this "
                f"rlcore ({core_version()}) speaks plugin API {PLUGIN_API}. Install a version "
                f"of {dist} built for API {PLUGIN_API}, or an rlcore that speaks API {api}."
            )
        try:
            self._pm.register(module, name=name)
        except pluggy.PluginValidationError as exc:
            raise errors.PluginValidationError(_explain_validation(name, label, module, exc)) from exc
        self._loaded[name] = LoadedPlugin(name, module, dist, version, builtin)
        self._check_chain_impl_options(name)

    def _check_chain_impl_options(self, name: str) -> None:
        module = self._loaded[name].module
        for hook in CHAIN_HOOKS:
            for impl in getattr(self._pm.hook, hook).get_hookimpls():
                if impl.plugin is module and (impl.tryfirst or impl.trylast or impl.wrapper or impl.hookwrapper):
                    label = self._loaded[name].label
                    self._pm.unregister(module)
                    del self._loaded[name]
                    raise errors.PluginValidationError(
                        f"Plugin {name!r} ({label}) marks its {hook!r} implementation tryfirst/"
                        f"trylast/wrapper; chain hooks run in the order of the config's plugins: list."
                    )

    def _settle(self) -> None:
        """After plugins joined: chain order, every hook known, no provider name twice."""
        self._reorder()
        self._check_pending()
        for hook in PROVIDER_HOOKS:
            self._providers(hook)

    def _reorder(self) -> None:
        # pluggy calls implementations last-registered-first; re-register the ordered plugins
        # in reverse so chain hooks run in config order.
        for name in self._order:
            mod = self._loaded[name].module
            if self._pm.is_registered(mod):
                self._pm.unregister(mod)
        for name in reversed(self._order):
            self._pm.register(self._loaded[name].module, name=name)

    def _check_pending(self) -> None:
        known = list(ALL_HOOKS)
        for name, loaded in self._loaded.items():
            for hc in self._pm.get_hookcallers(loaded.module) or []:
                if hc.has_spec():
                    continue
                impls = [i for i in hc.get_hookimpls() if i.plugin is loaded.module]
                if impls and all(i.optionalhook for i in impls):
                    continue
                hint = _did_you_mean(hc.name, known)
                hint = f" {hint}" if hint else ""
                raise errors.PluginValidationError(
                    f"Plugin {name!r} ({loaded.label}) implements hook {hc.name!r}, which no "
                    f"rlcore hook spec defines.{hint} Known hooks: {', '.join(known)}."
                )
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise errors.PluginValidationError(f"Invalid plugin hook: {exc}") from exc

    # ------------------------------------------------------------------ introspection ----

    @property
    def active(self) -> list[str]:
        """Loaded plugin names: built-ins first, then config order."""
        built = [n for n, ld in self._loaded.items() if ld.builtin]
        return built + [n for n in self._order if n not in built]

    def plugin_label(self, name: str) -> str:
        ld = self._loaded.get(name)
        return ld.label if ld else name

    def implementers(self, hook: str) -> list[str]:
        """Active plugins implementing ``hook``, in call order."""
        by_module = {id(ld.module): n for n, ld in self._loaded.items()}
        impls = getattr(self._pm.hook, hook).get_hookimpls()
        return [by_module[id(i.plugin)] for i in reversed(impls) if id(i.plugin) in by_module]

    # ------------------------------------------------------------------ providers --------

    def _answers(self, hook: str, *expected: type, many: bool = False, **kwargs: Any) -> list[tuple[LoadedPlugin, Any]]:
        """Every active plugin's answer to ``hook`` but None (``many``: each item an implementation
        yields), in call order: the config's ``plugins:`` order, then the built-ins. An answer that
        is none of the ``expected`` types is an error naming the plugin."""
        by_module = {id(ld.module): ld for ld in self._loaded.values()}
        out = []
        for impl in reversed(getattr(self._pm.hook, hook).get_hookimpls()):
            ld = by_module[id(impl.plugin)]
            answer = call_hook(ld, hook, impl.function, *[kwargs[a] for a in impl.argnames])
            if many:  # a generator's body runs while it is read: read it under the same error
                answer = call_hook(ld, hook, lambda a=answer: list(a or ()))
            for item in (answer if many else [answer] if answer is not None else []):
                if not isinstance(item, expected):
                    raise errors.PluginValidationError(
                        f"Plugin {ld.name!r} ({ld.label}): hook {hook!r} must return "
                        f"{' or '.join(t.__name__ for t in expected)}{' objects' if many else ''}, "
                        f"got {type(item).__name__}"
                    )
                out.append((ld, item))
        return out

    def _providers(self, hook: str) -> dict[str, ProviderSpec]:
        out: dict[str, ProviderSpec] = {}
        for ld, spec in self._answers(hook, DESCRIPTORS[hook], many=True):
            spec = _with_source(spec, ld)
            if spec.name in out:
                first = out[spec.name]
                raise errors.PluginConflictError(
                    f"Conflicting plugins for {hook} {spec.name!r}: provided by "
                    f"{first.distribution} (plugin {first.plugin!r}) and by "
                    f"{spec.distribution} (plugin {spec.plugin!r}). Uninstall or deselect one."
                )
            out[spec.name] = spec
        return dict(sorted(out.items()))

    def forward_fns(self) -> dict[str, ForwardFnSpec]:
        return self._providers("forward_fn")  # type: ignore[return-value]

    def rollout_backends(self) -> dict[str, RolloutBackendSpec]:
        return self._providers("rollout_backend")  # type: ignore[return-value]

    def weight_syncs(self) -> dict[str, WeightSyncSpec]:
        return self._providers("weight_sync")  # type: ignore[return-value]

    def engines(self) -> dict[str, EngineSpec]:
        return self._providers("engine")  # type: ignore[return-value]

    def algorithms(self) -> dict[str, AlgorithmSpec]:
        """Registered algorithms (advantage estimator + policy loss), by name."""
        return self._providers("algorithm")  # type: ignore[return-value]

    def platforms(self) -> dict[str, PlatformSpec]:
        """Registered device platforms (built-in ``cpu``, ``cuda``), by name."""
        return self._providers("platform")  # type: ignore[return-value]

    def launchers(self) -> dict[str, LauncherSpec]:
        """Registered launchers (built-in ``local``), by name: ``cluster.backend`` picks one."""
        return self._providers("launcher")  # type: ignore[return-value]

    def environments(self) -> dict[str, EnvironmentSpec]:
        """Registered environments (built-in ``single_turn``, ``tools``), by name: ``environment.name`` picks one."""
        return self._providers("environment")  # type: ignore[return-value]

    def tools(self) -> dict[str, ToolSpec]:
        """Registered tools (built-in ``calc``), by name: ``environment.tools`` picks any number of them
        (:meth:`select_all`)."""
        return self._providers("tool")  # type: ignore[return-value]

    def trackers(self) -> dict[str, TrackerSpec]:
        """Registered experiment trackers (built-in ``tensorboard``, ``mlflow``, ``wandb``, ``trackio``),
        by name: ``tracking.backends`` picks any number of them (:meth:`select_all`)."""
        return self._providers("tracker")  # type: ignore[return-value]

    def providers(self, hook: str) -> dict[str, ProviderSpec]:
        if hook not in DESCRIPTORS:
            raise ValueError(f"{hook!r} is not a provider hook ({', '.join(PROVIDER_HOOKS)})")
        return self._providers(hook)

    def select(self, hook: str, name: str, *, key: str) -> ProviderSpec:
        """The provider ``name`` for ``hook``; an unknown name names the config ``key`` and
        lists the valid choices (and the plugin that would provide it, if known). For a role whose
        descriptor selects one provider (``ProviderSpec.selects == "one"``)."""
        if hook in DESCRIPTORS and DESCRIPTORS[hook].selects != "one":
            raise ValueError(f"a config selects many {hook} providers at once: use select_all({hook!r}, names, ...)")
        return self._select(hook, name, key=key)

    def select_all(self, hook: str, names: Sequence[str], *, key: str) -> list[ProviderSpec]:
        """The providers ``names`` lists, in that order, for a role whose descriptor selects many
        (``ProviderSpec.selects == "many"``: ``tracker``). An unknown name is :meth:`select`'s error
        naming ``key``; a name listed twice is an error naming ``key``."""
        if hook in DESCRIPTORS and DESCRIPTORS[hook].selects != "many":
            raise ValueError(f"a config selects one {hook} provider: use select({hook!r}, name, ...)")
        norms = [str(n).strip().lower() for n in names]
        twice = sorted({n for n in norms if norms.count(n) > 1})
        if twice:
            raise errors.ConfigError(f"{key}: {', '.join(map(repr, twice))} listed more than once", key=key)
        return [self._select(hook, n, key=key) for n in norms]

    def _select(self, hook: str, name: str, *, key: str) -> ProviderSpec:
        available = self.providers(hook)
        norm = str(name).strip().lower()
        if norm in available:
            return available[norm]
        choices = ", ".join(available) or "none"
        plugin = first_party_plugin_of(norm)
        if plugin is not None and plugin not in self._loaded:
            hint = f" {hook} {norm!r} comes with the plugin {plugin!r}" + self._activation_hint(plugin)
        elif (rec := inactive_provider(self, hook, norm)) is not None:  # a third-party plugin's
            hint = f" {hook} {norm!r} {activation_hint(rec)}."
        else:
            # a misspelling of a provider here, or of a first-party plugin not yet active
            inactive = [p for p in KNOWN_DISTRIBUTIONS if p not in self._loaded]
            close = errors.closest_name(norm, [*available, *inactive])
            hint = f" Did you mean {close!r}?" if close else ""
            if close in inactive and close not in available:
                hint += f" It comes with the plugin {close!r}" + self._activation_hint(close)
        raise errors.UnknownProviderError(
            f"{key}: {name!r} is not a known {hook}. Choose one of: {choices}.{hint}", key=key
        )

    def _activation_hint(self, plugin: str) -> str:
        """How to make first-party ``plugin`` active, given what this manager knows is installed."""
        dist = KNOWN_DISTRIBUTIONS[plugin]
        eps = self.installed().get(plugin)
        if eps:
            return f" ({eps[0].label}), which is installed but not active: add {plugin} to the config's plugins: list."
        if self._autoload:
            return (f", which is not installed. Install it with: pip install {dist}, and add {plugin} "
                    f"to the config's plugins: list.")
        return f": add it to plugins: (and pip install {dist} if it is not installed)."

    # ------------------------------------------------------------------ declarations -----

    def plugin_settings(self) -> list[PluginSettings]:
        out: dict[str, PluginSettings] = {}
        for ld, ps in self._answers("plugin_settings", PluginSettings):
            ps = dataclasses.replace(ps, plugin=ld.name)
            if ps.section in out:
                other = out[ps.section]
                raise errors.PluginConflictError(
                    f"Config section {ps.section!r} is claimed by plugin {other.plugin!r} "
                    f"({self.plugin_label(other.plugin or '')}) and by plugin {ld.name!r} ({ld.label})"
                )
            out[ps.section] = ps
        return list(out.values())

    def constraints(self) -> list[tuple[str, IncompatibleWith | RequiresCapability]]:
        return [(ld.name, c) for ld, c in self._answers("constraints", IncompatibleWith, RequiresCapability, many=True)]

    # ------------------------------------------------------------------ chains -----------

    def forward_request(self, ctx: Any) -> ForwardRequest:
        """Every plugin's request merged. An output the selected engine cannot produce is an
        error naming the engine and the plugin(s) that asked, never a request dropped silently:
        ``mtp_hidden`` needs an engine that declares ``mtp`` and whose model has MTP layers here."""
        req = ForwardRequest()
        asked: list[str] = []
        for ld, r in self._answers("forward_request", ForwardRequest, ctx=ctx):
            if r.mtp_hidden:
                asked.append(ld.name)
            req = req.merge(r)
        config = getattr(ctx, "config", None)
        if asked and config is not None:
            engine = self.select("engine", config.engine.name, key="engine.name")
            gap = engine.gaps(config).get(Cap.MTP) if Cap.MTP in engine.capabilities else None
            if Cap.MTP not in engine.capabilities or gap is not None:
                who = ", ".join(f"{n!r} ({self.plugin_label(n)})" for n in asked)
                why = (f"its model has no MTP layers ({gap})" if gap is not None
                       else "it has no MTP layers (it does not declare capability 'mtp')")
                raise errors.MissingCapabilityError(
                    f"plugin(s) {who} asked for MTP hidden states (ForwardRequest.mtp_hidden) in the "
                    f"{getattr(ctx, 'phase', '?')} pass, but engine {engine.name!r} ({engine.distribution}): {why}; "
                    f"select a model with MTP layers (engine.model.tiny.mtp_layers >= 1, a MiMo directory, or "
                    f"engine.name=megatron with num_nextn_predict_layers > 0) or deactivate the plugin"
                )
        return req

    def postprocess(self, ctx: Any, output: Any) -> list[tuple[str, PostprocessResult]]:
        """Every active plugin's postprocess result, in chain order, with its plugin name."""
        return [(ld.name, r) for ld, r in self._answers("postprocess", PostprocessResult, ctx=ctx, output=output)]

    def has_router_hooks(self) -> bool:
        return bool(self._pm.hook.router_hook.get_hookimpls())

    def router_hook(self, call: Any) -> RouterDecision | None:
        """The first active plugin's answer that is not None (config order), as pluggy's
        ``firstresult``; an implementation that raises is named (:func:`call_hook`)."""
        by_module = {id(ld.module): ld for ld in self._loaded.values()}
        for impl in reversed(self._pm.hook.router_hook.get_hookimpls()):
            ld = by_module.get(id(impl.plugin))
            args = [{"call": call}[a] for a in impl.argnames]
            answer = impl.function(*args) if ld is None else call_hook(ld, "router_hook", impl.function, *args)
            if answer is not None:
                return answer
        return None

    def step_end(self, ctx: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, r in self._answers("step_end", dict, ctx=ctx):
            out.update(r)
        return out

    # ------------------------------------------------------------------ listing ----------

    def describe(self, selected: Sequence[str] = ()) -> list[PluginRecord]:
        """A record per installed plugin (and per registered one without an entry point),
        without activating anything (see :func:`rlcore.listing.describe_plugins`)."""
        return describe_plugins(self.installed(), self._loaded, selected=selected,
                                disabled=self.disabled_plugins())


def hook_error(plugin: str, label: str, hook: str, exc: BaseException) -> errors.PluginHookError:
    """The one-line error for plugin ``plugin`` (``label``: its distribution and version) whose
    ``hook`` (a hook, or what one provided: ``environment 'x'.reset``, a factory) raised ``exc``."""
    return errors.PluginHookError(f"plugin {plugin!r} ({label}): {hook} raised {type(exc).__name__}: "
                                  f"{errors.one_line(exc)}", plugin=plugin, hook=hook)


def call_hook(ld: Any, hook: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, plugin ``ld``'s implementation of ``hook``: an exception it raises becomes
    one :class:`~rlcore.errors.PluginHookError` naming the plugin and the hook (the original as
    its ``__cause__``). rlcore's own errors pass unchanged: they already say what to do."""
    try:
        return fn(*args)
    except errors.RLCoreError:
        raise
    except Exception as exc:
        raise hook_error(ld.name, ld.label, hook, exc) from exc


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """``Did you mean 'x'?`` for the closest of ``candidates`` to a misspelled ``name``, or ''."""
    close = errors.closest_name(name, candidates)
    return f"Did you mean {close!r}?" if close else ""


def _with_source(spec: ProviderSpec, ld: LoadedPlugin) -> ProviderSpec:
    return dataclasses.replace(spec, distribution=ld.label, plugin=ld.name)


def _explain_validation(name: str, label: str, module: Any, exc: Exception) -> str:
    # pluggy says e.g. "Plugin 'x' for hook 'postprocess'\nhookimpl definition: postprocess(ctx, foo)
    # Argument(s) {'foo'} are declared in the hookimpl but can not be found in the hookspec"
    text = str(exc).replace("\n", " ").strip()
    hook = None
    for h in ALL_HOOKS:
        if f"'{h}'" in text:
            hook = h
            break
    spec_args = ""
    if hook:
        spec = getattr(RLCoreSpecs, hook)
        params = [p for p in inspect.signature(spec).parameters if p != "self"]
        spec_args = f" The spec {hook}({', '.join(params)}) provides: {', '.join(params) or 'no arguments'}."
    return f"Plugin {name!r} ({label}) has an invalid hook implementation: {text}.{spec_args}"


def load_plugin_manager(config_plugins: Sequence[str] | None = None) -> PluginManager:
    """A manager with the built-ins and the requested plugins active."""
    pm = PluginManager()
    pm.activate(PluginManager.requested_plugins(config_plugins), source=PluginManager.plugin_list_source())
    return pm
