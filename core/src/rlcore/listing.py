"""What ``rlcore plugins`` shows: one :class:`PluginRecord` per installed or registered plugin,
with its status, the hooks it implements and the names it provides.

A plugin is described without activating it: its module is imported into a scratch pluggy
manager to read its hooks and provider names. Plugin modules defer heavy imports to their
factories, so this stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from rlcore.discovery import ENV_DISABLED, InstalledPlugin, LoadedPlugin, plugin_api_of
from rlcore.hookspecs import PROJECT, PROVIDER_HOOKS, ROLES, RLCoreSpecs
from rlcore.types import PLUGIN_API


@dataclass
class PluginRecord:
    """One row of ``rlcore plugins``."""

    name: str
    distribution: str
    version: str
    status: str  # active | installed | blocked | broken
    hooks: list[str] = field(default_factory=list)
    provides: dict[str, list[str]] = field(default_factory=dict)
    builtin: bool = False
    module: str = ""
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "hooks": self.hooks,
            "provides": self.provides,
            "builtin": self.builtin,
            "module": self.module,
            "error": self.error,
        }


def describe_plugins(
    installed: Mapping[str, Sequence[InstalledPlugin]],
    loaded: Mapping[str, LoadedPlugin],
    *,
    selected: Iterable[str] = (),
    disabled: Iterable[str] = (),
) -> list[PluginRecord]:
    """A record per installed plugin, and per ``loaded`` one without an entry point.

    ``loaded`` plugins, built-ins and ``selected`` names are ``active``; names in ``disabled``
    are ``blocked``; a plugin whose import fails or whose entry-point name two distributions
    claim is ``broken``, with the reason in ``error``.
    """
    selected = set(selected)
    disabled = set(disabled)
    records: list[PluginRecord] = []
    for name, eps in sorted(installed.items()):
        for ep in eps:
            rec = PluginRecord(name, ep.distribution, ep.version, "installed", builtin=ep.builtin, module=ep.value)
            if len(eps) > 1:
                rec.status = "broken"
                rec.error = "entry-point name claimed by " + " and ".join(e.label for e in eps)
                records.append(rec)
                continue
            if name in disabled:
                rec.status = "blocked"
                rec.error = f"disabled by {ENV_DISABLED}"
                records.append(rec)
                continue
            ld = loaded.get(name)
            try:
                module = ld.module if ld else ep.entry_point.load()
            except Exception as exc:  # noqa: BLE001
                rec.status = "broken"
                rec.error = f"{type(exc).__name__}: {exc}"
                records.append(rec)
                continue
            _fill_record(rec, module)
            if rec.status != "blocked":
                if ld is not None or ep.builtin or name in selected:
                    rec.status = "active"
            records.append(rec)
    for name, ld in loaded.items():
        if name not in installed:
            rec = PluginRecord(name, ld.distribution, ld.version, "active", builtin=ld.builtin,
                               module=getattr(ld.module, "__name__", ""))
            _fill_record(rec, ld.module)
            records.append(rec)
    return records


def _fill_record(rec: PluginRecord, module: Any) -> None:
    api = plugin_api_of(module)
    if api != PLUGIN_API:
        rec.status = "blocked"
        rec.error = f"built for plugin API {api}, this rlcore speaks {PLUGIN_API}"
        return
    scratch = pluggy.PluginManager(PROJECT)
    scratch.add_hookspecs(RLCoreSpecs)
    try:
        scratch.register(module, name=rec.name)
        rec.hooks = sorted(hc.name for hc in (scratch.get_hookcallers(module) or []))
        for hook in PROVIDER_HOOKS:
            if hook in rec.hooks:
                names: list[str] = []
                for res in getattr(scratch.hook, hook)():
                    names.extend(spec.name for spec in (res or ()))
                rec.provides[hook] = sorted(names)
        if "plugin_settings" in rec.hooks:
            ps = scratch.hook.plugin_settings()
            if ps:
                rec.provides["config_section"] = [p.section for p in ps if p is not None]
    except Exception as exc:  # noqa: BLE001
        rec.status = "broken"
        rec.error = f"{type(exc).__name__}: {exc}"


def role_rows(records: list[PluginRecord]) -> list[dict[str, Any]]:
    """One row per role of :data:`rlcore.hookspecs.ROLES`: the hook, the config key that selects
    (``None``: core's own rule), the descriptor type, one or many, and the provider names the
    listed plugins register for it (``rlcore plugins --roles``)."""
    return [{"role": role.hook, "key": role.key, "selected_by": role.selected_by,
             "descriptor": role.descriptor.__name__, "selects": role.selects,
             "provided": sorted({name for rec in records for name in rec.provides.get(role.hook, [])})}
            for role in ROLES.values()]
