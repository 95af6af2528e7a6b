"""Config checks of the settings the ``local`` rollout backend reads (``rollout.draft_depths``,
``rollout.local_update``), kept apart from :mod:`rlcore.config` as :mod:`rlcore.cluster_settings`
is: each names the key it refuses. That the selected backend reads them at all is a capability
(``policy_mtp_drafts``, ``in_place_load``) the built-in ``local`` plugin requires (rlcore.builtin.local)."""

from __future__ import annotations

from typing import Any

from rlcore.errors import ConfigError

#: ``rollout.local_update``: how the local rollout loads a push (see :class:`rlcore.config.RolloutConfig`)
LOCAL_UPDATE_MODES = ("staged", "in_place")


def check_local_rollout(cfg: Any) -> None:
    """Refuse local-rollout settings that another backend would ignore, or that cannot hold."""
    _check_draft(cfg)


def _check_draft(cfg: Any) -> None:
    depths = cfg.rollout.draft_depths
    if not depths:
        return
    if cfg.rollout.return_routed_experts:
        raise ConfigError("rollout.draft_depths (speculative local rollout) cannot return routed experts",
                          key="rollout.draft_depths")
    model = cfg.engine.model
    # the tiny model an engine creates (rlcore.engines.tiny, whichever engine) has tiny.mtp_layers MTP layers
    if not model.path and depths > model.tiny.mtp_layers:
        raise ConfigError(f"rollout.draft_depths={depths} but engine.model.tiny.mtp_layers={model.tiny.mtp_layers}",
                          key="rollout.draft_depths")
