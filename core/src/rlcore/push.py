"""One weight push from the trainer into the rollout backend, and what the backend reports.

Around the push: pause the backend, release its KV cache (when configured), push, restore, reset
its prefix cache, resume; then the checks that make a push trustworthy: the backend reports the
pushed weight version, and a backend that drafts speculatively (``draft_weight_version`` not
None) reports the same version for its draft — a draft left on older weights makes acceptance
collapse silently (SGLang #27718, vLLM level-2 sleep, vllm-ascend #13209), so a lag fails the
run here. Metrics: ``rollout/draft_weight_version``, the backend's ``memory_metrics()`` (KV
cache bytes freed by the release) and, from a sync that reports where its push's time went
(``SyncReport.details["phases"]``, named as :data:`rlcore.sync.PUSH_PHASES`), one
``sync/<phase>_seconds`` each; from a delta push (``sync.delta``, :mod:`rlcore.delta`):
``sync/delta`` (1.0: a delta, 0.0: a full push, ``sync/delta_reason`` saying why), ``sync/model_bytes``
(the bytes of a full push; ``sync_bytes`` is what was sent), ``sync/delta_tensors_<kind>`` (how many
tensors went unchanged, as rows, as elements, dense) and ``sync/delta_encode_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlcore.errors import WeightSyncError
from rlcore.sync import PUSH_PHASES
from rlcore.types import Cap


def push_weights(backend: Any, sync: Any, weights: Iterable[Any], version: int,
                 release_kv: bool) -> tuple[Any, dict[str, Any]]:
    caps = backend.capabilities()
    can_pause = Cap.PAUSE in caps
    metrics: dict[str, Any] = {}
    if can_pause:
        backend.pause()
    if release_kv:
        backend.release_memory(frozenset({"kv_cache"}))
        metrics.update(memory_metrics(backend))
    try:
        report = sync.push(weights, backend, version)
    finally:
        if release_kv:
            backend.resume_memory(frozenset({"kv_cache"}))
        if Cap.PREFIX_CACHE_RESET in caps:
            backend.reset_prefix_cache()
        if can_pause:
            backend.resume()
    finalize = getattr(sync, "finalize", None)
    if finalize is not None:  # verification that needs a serving engine (probe log-probs)
        report = finalize(backend, report)
    if backend.weight_version != version:
        raise WeightSyncError(
            f"after the push the backend reports weight version {backend.weight_version}, expected {version}",
            receiver_version=backend.weight_version,
        )
    metrics.update(check_draft_version(backend, version))
    metrics.update(phase_metrics(report))
    metrics.update(delta_metrics(report))
    return report, metrics


def phase_metrics(report: Any) -> dict[str, float]:
    """``{sync/<phase>_seconds: seconds}`` for each of :data:`~rlcore.sync.PUSH_PHASES` the
    report's ``details["phases"]`` names (a sync that reports no phases adds none)."""
    phases = (getattr(report, "details", None) or {}).get("phases") or {}
    return {f"sync/{p}_seconds": float(phases[p]) for p in PUSH_PHASES if p in phases}


def delta_metrics(report: Any) -> dict[str, float | str]:
    """What a push with ``sync.delta`` reports of its encoding (see the module docstring); none
    without it."""
    details = getattr(report, "details", None) or {}
    if "delta" not in details:
        return {}
    out: dict[str, float | str] = {"sync/delta": float(details["delta"] == "delta"),
                                   "sync/model_bytes": float(details["model_bytes"]),
                                   "sync/delta_encode_seconds": float(details.get("delta_seconds", 0.0))}
    out.update({f"sync/{k}": float(v) for k, v in details.items() if k.startswith("delta_tensors_")})
    if details.get("delta_reason"):
        out["sync/delta_reason"] = str(details["delta_reason"])
    return out


def check_draft_version(backend: Any, version: int) -> dict[str, float]:
    """``{rollout/draft_weight_version: v}`` for a drafting backend; a draft behind ``version``
    is a :class:`WeightSyncError`."""
    draft = getattr(backend, "draft_weight_version", None)
    if draft is None:
        return {}
    if draft != version and getattr(backend, "stale_draft_diagnostic", False):
        # a diagnostic run that keeps the draft stale on purpose (rlcore-vllm's
        # vllm.diagnostic_skip_draft_push_from): measured, reported, not fatal
        return {"rollout/draft_weight_version": float(draft), "rollout/draft_lag": float(version - draft)}
    if draft != version:
        raise WeightSyncError(
            f"the rollout's speculative draft is at weight version {draft} but the policy was pushed as version "
            f"{version}: the draft weights did not follow the push (a stale draft keeps sampling exact but its "
            f"acceptance collapses); check that the sync carries the MTP tensors (model.mtp_layers.*) to the draft",
            receiver_version=backend.weight_version,
        )
    return {"rollout/draft_weight_version": float(draft)}


def memory_metrics(backend: Any) -> dict[str, float]:
    get = getattr(backend, "memory_metrics", None)
    return dict(get()) if get is not None else {}


def rollout_metrics(backend: Any) -> dict[str, float]:
    """The backend's metrics of its last ``generate`` (acceptance per draft depth), if it has any."""
    get = getattr(backend, "rollout_metrics", None)
    return dict(get()) if get is not None else {}
