"""Where plugins come from: the ``rlcore`` entry-point group, the environment's selection, and
what to ``pip install`` when a plugin is missing.

Nothing here imports a plugin module: entry points are read from installed distributions'
metadata, so listing what is installed stays cheap. :class:`rlcore.manager.PluginManager`
imports and registers them.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Any

from rlcore import errors

ENTRY_POINT_GROUP = "rlcore"
ENV_PLUGINS = "RLCORE_PLUGINS"
ENV_DISABLED = "RLCORE_DISABLED_PLUGINS"
CORE_DISTRIBUTION = "rlcore"

#: first-party plugins (entry-point names) and the distribution of this repository that provides
#: each, for "pip install" hints. Only distributions that exist: core/tests/test_manager_errors.py
#: checks every one against the repository's pyproject.toml files.
KNOWN_DISTRIBUTIONS = {
    "algorithms": "rlcore-algorithms",
    "fused": "rlcore-fused",
    "megatron": "rlcore-megatron",
    "npu": "rlcore-npu",
    "ray": "rlcore-ray",
    "mtp": "rlcore-mtp",
    "replay": "rlcore-replay",
    "sandbox": "rlcore-sandbox",
    "sglang": "rlcore-sglang",
    "vllm": "rlcore-vllm",
}


def install_hint(name: str) -> str:
    dist = KNOWN_DISTRIBUTIONS.get(name)
    if dist:
        return f"pip install {dist}"
    return (
        f"no known distribution provides it; install the package that declares "
        f"[project.entry-points.{ENTRY_POINT_GROUP}] {name} = ..."
    )


#: the algorithms that moved out of core into rlcore-algorithms (``algorithm.name: gspo``)
MOVED_ALGORITHMS = ("reinforce_pp", "reinforce_pp_baseline", "opo", "remax", "grpo_passk", "gdpo",
                    "optimal_token_baseline", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "gmpo",
                    "dppo_tv", "dppo_kl", "dro")
#: first-party providers not named after their plugin: they kept the name users' configs already
#: had when they moved out of core (``sync.name: mapped`` came with rlcore-ray, ``environment.tools:
#: [python]`` with rlcore-sandbox, the algorithms above with rlcore-algorithms)
RENAMED_PROVIDERS = {"mapped": "ray", "python": "sandbox", **dict.fromkeys(MOVED_ALGORITHMS, "algorithms")}


def first_party_plugin_of(provider: str) -> str | None:
    """The first-party plugin that provides ``provider``, if one does: first-party plugins name
    their providers after themselves (``fused``, ``megatron``) or ``<plugin>-<variant>``
    (``sglang-nccl``), except the few in :data:`RENAMED_PROVIDERS`."""
    if provider in RENAMED_PROVIDERS:
        return RENAMED_PROVIDERS[provider]
    plugin = provider.split("-", 1)[0]
    return plugin if plugin in KNOWN_DISTRIBUTIONS else None


def parse_plugin_list(value: str) -> list[str]:
    return [p.strip().lower() for p in value.split(",") if p.strip()]


@dataclass(frozen=True)
class InstalledPlugin:
    """An entry point in the ``rlcore`` group (found without importing it)."""

    name: str
    value: str
    distribution: str
    version: str
    entry_point: Any = field(compare=False, repr=False)

    @property
    def builtin(self) -> bool:
        return self.distribution == CORE_DISTRIBUTION

    @property
    def label(self) -> str:
        return f"{self.distribution} {self.version}"


@dataclass
class LoadedPlugin:
    """A plugin module registered with a manager under ``name``, and where it came from."""

    name: str
    module: Any
    distribution: str
    version: str
    builtin: bool

    @property
    def label(self) -> str:
        return f"{self.distribution} {self.version}"


def discover_entry_points() -> dict[str, list[InstalledPlugin]]:
    """Every entry point in the ``rlcore`` group, by name (a list: two distributions may
    claim one name, which is a conflict reported when that name is used)."""
    found: dict[str, list[InstalledPlugin]] = {}
    seen: set[tuple[str, str, str]] = set()
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        dname = dist.metadata["Name"] if dist is not None else "<unknown>"
        dver = dist.version if dist is not None else "?"
        key = (ep.name, ep.value, dname)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        found.setdefault(ep.name.lower(), []).append(
            InstalledPlugin(ep.name.lower(), ep.value, dname, dver, ep)
        )
    return found


def core_entry_points() -> list[InstalledPlugin]:
    """Core's built-in plugins: the ``rlcore`` entry points of the ``rlcore`` distribution itself,
    by name. Built-ins are registered through them exactly like external plugins, so the manager
    never imports :mod:`rlcore.builtin` by name."""
    try:
        dist = md.distribution(CORE_DISTRIBUTION)
    except md.PackageNotFoundError as exc:
        raise errors.PluginError(
            f"rlcore's built-in plugins are entry points of the {CORE_DISTRIBUTION!r} distribution, "
            f"which is not installed here (is rlcore only on PYTHONPATH?). Install it: pip install -e core"
        ) from exc
    eps = (ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP)
    return sorted(
        (InstalledPlugin(ep.name.lower(), ep.value, CORE_DISTRIBUTION, dist.version, ep) for ep in eps),
        key=lambda p: p.name,
    )


def plugin_api_of(module: Any) -> int | None:
    api = getattr(module, "PLUGIN_API", None)
    return api if isinstance(api, int) else None


def core_version() -> str:
    from rlcore import __version__

    return __version__
