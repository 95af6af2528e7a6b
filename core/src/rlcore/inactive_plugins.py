"""Names a config asks for that only an installed-but-inactive plugin provides.

A plugin is imported only when ``plugins:`` (or ``RLCORE_PLUGINS``) lists it, so the providers of
an installed plugin that is not listed are unknown to the run. When a config names one, the error
says which plugin has it and how to activate it, for third-party plugins as for first-party ones.
Only ever called on the error path: describing the installed plugins imports their modules.
"""

from __future__ import annotations

from typing import Any

from rlcore import errors


def inactive_provider(pm: Any, hook: str, name: str) -> Any:
    """The :class:`~rlcore.listing.PluginRecord` of an installed plugin that is not active and
    whose ``hook`` provides ``name``, or ``None``."""
    try:
        records = pm.describe()
    except Exception:  # noqa: BLE001 - a hint only: never hide the error it would explain
        return None
    for rec in records:
        if rec.status in ("installed", "blocked") and name in rec.provides.get(hook, []):
            return rec
    return None


def activation_hint(rec: Any) -> str:
    """How to make the plugin of ``rec`` active (or why it cannot be)."""
    label = f"{rec.distribution} {rec.version}"
    if rec.status == "blocked":
        return f"comes with the plugin {rec.name!r} ({label}), which is installed but blocked ({rec.error})"
    return (f"comes with the plugin {rec.name!r} ({label}), which is installed but not active: add "
            f"{rec.name} to the config's plugins: list (or RLCORE_PLUGINS)")


def require_active_algorithm(raw: Any, pm: Any) -> None:
    """Before validation: an ``algorithm.name`` that an installed but inactive plugin provides
    is an error naming that plugin; one of a first-party plugin (``gspo``: rlcore-algorithms) is
    the manager's error saying what to install and add to ``plugins:``. Any other unknown name is
    left to the config's own error, which lists the choices."""
    from omegaconf import OmegaConf

    from rlcore.discovery import first_party_plugin_of

    name = str(OmegaConf.select(raw, "algorithm.name", default="grpo") or "grpo").strip().lower()
    available = pm.algorithms()
    if name in available:
        return
    if first_party_plugin_of(name) is not None:
        pm.select("algorithm", name, key="algorithm.name")  # raises, naming the plugin and its pip line
    rec = inactive_provider(pm, "algorithm", name)
    if rec is None:
        return
    raise errors.UnknownProviderError(
        f"algorithm.name: {name!r} {activation_hint(rec)}. Active algorithms: {', '.join(available) or 'none'}",
        key="algorithm.name",
    )
