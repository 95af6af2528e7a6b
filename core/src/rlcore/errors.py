"""Errors a user can act on. Each message names what is wrong and what to do about it."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "BatchShapeError", "BucketError", "CheckpointError", "ConfigError", "ConfigErrors", "IncompatiblePluginsError",
    "LoopStallError", "MissingCapabilityError", "NonFiniteError", "PluginAPIError", "PluginConflictError",
    "PluginError", "PluginHookError", "PluginImportError", "PluginNotInstalledError", "PluginValidationError",
    "RLCoreError", "RewardError", "RolloutError", "RunOutputError", "UnknownProviderError", "WeightSyncError",
]


class RLCoreError(Exception):
    """Base class of every error rlcore raises on purpose."""


class ConfigError(RLCoreError, ValueError):
    """A config value is missing, unknown or of the wrong type; the message names the key."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class ConfigErrors(ConfigError):
    """Every problem found in one config at once (each a :class:`ConfigError` naming its key), so
    one edit fixes them all; the message is one line per problem. ``key`` is the first one's."""

    def __init__(self, problems: list[ConfigError]):
        self.problems = list(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problems in the config:\n{lines}",
                         key=self.problems[0].key if self.problems else None)


class PluginError(RLCoreError):
    """Base of plugin loading and selection errors."""


class PluginNotInstalledError(PluginError):
    """A plugin named in the config (or ``RLCORE_PLUGINS``) has no installed entry point."""


class PluginImportError(PluginError):
    """A plugin's module raised while being imported."""


class PluginAPIError(PluginError):
    """A plugin was built for another ``PLUGIN_API``."""


class PluginConflictError(PluginError):
    """Two distributions provide the same plugin or provider name."""


class PluginValidationError(PluginError):
    """A hook implementation does not fit its spec, or implements a hook that does not exist."""


class PluginHookError(PluginError):
    """A plugin's hook (or what a hook provided: a factory, an environment's ``reset``/``step``/
    ``final_reward``) raised; the one-line message names the plugin, its distribution, the hook
    and the exception. ``plugin`` and ``hook`` say the same for code; ``__cause__`` is the
    original exception."""

    def __init__(self, message: str, plugin: str | None = None, hook: str | None = None):
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook

    def __reduce__(self):  # picklable with its fields: ranks and Ray actors pass it on
        return (type(self), (str(self), self.plugin, self.hook))


def closest_name(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate a misspelled ``name`` most likely meant, if any is close (difflib)."""
    import difflib

    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1)
    return close[0] if close else None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc``'s message on one line, cut to ``limit`` characters."""
    text = " ".join(str(exc).split())
    return text[:limit] + ("..." if len(text) > limit else "")


class UnknownProviderError(PluginError, ConfigError):
    """The config selects a provider name that no active plugin registers."""


class IncompatiblePluginsError(PluginError):
    """The selected stack violates a constraint a plugin declared."""


class MissingCapabilityError(PluginError):
    """A feature needs a capability the selected provider does not declare."""


class BatchShapeError(RLCoreError, ValueError):
    """A tensor handed to the packed batch has the wrong shape; the message says the expected one."""


class BucketError(RLCoreError, ValueError, TypeError):
    """The weight stream handed to the bucket builder holds something it cannot flatten (not a
    dense tensor), or the bucket size or alignment is unusable; the message names the tensor."""


class WeightSyncError(RLCoreError):
    """A weight push failed or could not be verified. ``receiver_version`` is the version the
    receiver is known to hold afterwards (``None`` when it cannot be trusted any more)."""

    def __init__(self, message: str, receiver_version: int | None = None):
        super().__init__(message)
        self.receiver_version = receiver_version


class RolloutError(RLCoreError):
    """The rollout backend failed or was used in a state that does not allow the call."""


class LoopStallError(RolloutError):
    """A party of the overlapped loop (the trainer, the rollout producer, a push) did not answer
    within its ``loop.timeouts`` key; the message names the party, what it was doing and the key
    (:mod:`rlcore.rollout_producer`)."""


class NonFiniteError(RLCoreError):
    """A reward, advantage, loss, gradient norm or weight is NaN or infinite. ``what`` names the
    quantity (``reward``, ``advantages``, ``loss``, ``grad_norm``, ``weights``); ``skippable``
    says whether ``training.on_nonfinite: skip`` may drop the step instead of stopping (the
    weights are still the last good ones)."""

    def __init__(self, message: str, what: str, skippable: bool = False):
        super().__init__(message)
        self.what = what
        self.skippable = skippable

    def __reduce__(self):  # picklable with its fields: ranks and Ray actors pass it on
        return (type(self), (str(self), self.what, self.skippable))


class RewardError(RLCoreError):
    """A reward function failed: it returned something that is not a real number a float32 can
    hold, raised, or did not return within ``data.reward_timeout_seconds``; the message names the
    function, the sample and the step."""


class RunOutputError(RLCoreError):
    """The output directory cannot be used as asked (not empty, nothing to resume, unreadable
    metrics); the message names the path and the flag that changes the outcome."""


class CheckpointError(RunOutputError):
    """A checkpoint is missing, corrupt, truncated, unsafe to load, or from another config; the
    message names the file."""
