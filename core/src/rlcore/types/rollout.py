"""Rollout backends and the weight syncs that feed them.

What a ``rollout_backend`` provider builds (:class:`RolloutBackend`, sampling
:class:`Prompt` → :class:`Sample` under :class:`SamplingSettings`), the receiver protocols a
backend implements for weight syncs (:class:`BucketReceiver`, :class:`DiskReceiver`), and what a
``weight_sync`` provider builds (:class:`WeightSync`, reporting a :class:`SyncReport`). Import
these from :mod:`rlcore.types`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch


# --------------------------------------------------------------------------------------------
# Rollout backends
# --------------------------------------------------------------------------------------------


@dataclass
class SamplingSettings:
    """How to sample. ``n`` samples per prompt; ``temperature`` 0 means greedy; log-probs are
    always those of the processed distribution (after temperature and top-p/top-k), which is
    what the trainer recomputes. ``return_routed_experts`` asks for R3 routes."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    return_routed_experts: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Prompt:
    """One prompt: its token ids and its index in the step (samples are grouped by it)."""

    ids: list[int]
    index: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One generated sample.

    ``response_ids`` and ``logprobs`` are 1-D and equally long (``logprobs`` float32, the
    behaviour log-prob of each sampled token). ``weight_version`` is the version the engine
    held when it produced the sample (its last token's, when the weights changed mid-sample).
    ``weight_versions``: when the engine's weights changed while it generated the sample,
    ``((version, first_response_index), ...)`` in order: response tokens from
    ``first_response_index`` on came from ``version``. ``routed_experts``:
    ``[P + R - 1, num_hidden_layers, topk]`` ints in the engine's layer order (every token but
    the last), or None. ``response_mask``: in a multi-turn conversation (:mod:`rlcore.environments`),
    ``[R]`` bool, true on the tokens the engine generated (trained) and false on the observations
    inserted between turns (not trained; their ``logprobs`` are 0); ``None``: every token trained.
    """

    prompt_index: int
    prompt_ids: list[int]
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    weight_version: int
    finish_reason: str = "length"
    routed_experts: torch.Tensor | None = None
    weight_versions: tuple[tuple[int, int], ...] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    response_mask: torch.Tensor | None = None


MemoryTag = Literal["kv_cache", "weights"]


@runtime_checkable
class RolloutBackend(Protocol):
    """A sampling engine. Lifecycle: ``start`` → (``generate`` | pause/resume | memory
    release/resume | receive weights)* → ``shutdown``."""

    def capabilities(self) -> frozenset[str]:
        """The capabilities this instance has at runtime (at most the declared ones)."""
        ...

    def start(self, model_dir: str, version: int = 0) -> None:
        """Load the HF-format model at ``model_dir`` as weight version ``version``."""
        ...

    def generate(self, prompts: Sequence[Prompt], params: SamplingSettings) -> list[Sample]:
        """``params.n`` samples per prompt, ordered by prompt then sample."""
        ...

    @property
    def weight_version(self) -> int: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def release_memory(self, tags: frozenset[str]) -> None: ...

    def resume_memory(self, tags: frozenset[str]) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def shutdown(self) -> None: ...

    # Optional: ``lacking() -> dict[str, str]``, the declared capabilities this running instance
    # does not have, each with the reason; the trainer prints them.
    # Optional: ``rollout_metrics()`` / ``memory_metrics()`` / ``draft_weight_version`` /
    # ``stale_draft_diagnostic``: see rlcore.push and docs/hooks.md.
    # Optional: ``resumes_in_flight() -> bool``: a push may land while ``generate`` runs in another
    # thread, the requests in flight resuming on the new weights (rlcore.rollout_producer, docs/hooks.md).


@runtime_checkable
class BucketReceiver(Protocol):
    """Implemented by backends that accept flattened buckets in-process (capability
    ``receive_buckets``). A receiver stages what it gets and swaps it in on ``commit``, so
    ``abort`` (or a push that never commits) leaves it on its previous version."""

    def begin_update(self, version: int) -> None: ...

    def receive_bucket(self, bucket: Any) -> None: ...

    def commit_update(self, version: int) -> None: ...

    def abort_update(self) -> None: ...

    def weight_checksums(self, names: Iterable[str] | None = None) -> dict[str, int]: ...


@runtime_checkable
class DiskReceiver(Protocol):
    """Implemented by backends that reload an HF-format directory (capability
    ``receive_disk``): all-or-nothing, the version changes only when the load succeeded."""

    def load_from_disk(self, model_dir: str, version: int) -> None: ...

    def weight_checksums(self, names: Iterable[str] | None = None) -> dict[str, int]: ...


def implements(obj: Any, protocol: type) -> bool:
    """Whether ``obj`` has every public method of ``protocol``, looked up as a call looks it up
    (through ``__getattr__``, so a wrapper that forwards to the backend it wraps counts).
    ``isinstance`` against a runtime-checkable protocol looks members up statically from Python
    3.12 on (``inspect.getattr_static``) and misses forwarded methods: on 3.12 the trainer ranks'
    wrapper of the rollout fleet was refused as "not a BucketReceiver" (found on the GPU machine).
    Annotated data members (``Platform.device_type``) must be present too, as ``isinstance`` asks.
    A test fails when code in core or a plugin uses ``isinstance`` against a runtime-checkable
    protocol (``core/tests/test_protocol_checks.py``)."""
    methods = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    data = [n for n in getattr(protocol, "__annotations__", {}) if not n.startswith("_")]  # e.g. Platform.device_type
    return all(callable(getattr(obj, n, None)) for n in methods) and all(hasattr(obj, n) for n in data)


# --------------------------------------------------------------------------------------------
# Weight sync
# --------------------------------------------------------------------------------------------


@dataclass
class SyncReport:
    """What a push did. ``verified`` is True only when the receiver's state was checked
    against what was sent (``checked`` tensors, all matching)."""

    version: int
    num_tensors: int
    num_buckets: int
    bytes: int
    seconds: float
    verified: bool
    checked: int = 0
    method: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


@runtime_checkable
class WeightSync(Protocol):
    """Moves trainer weights into a rollout backend.

    ``push`` consumes the engine's export stream (HF names, full tensors), moves it into
    ``target`` and sets the target's weight version to ``version``. It must raise
    :class:`rlcore.errors.WeightSyncError` when anything fails or the verification finds a
    mismatch, and must not leave the target serving a mix of versions without saying so.
    Core pauses the backend and releases its KV cache around the call when the backend can.
    """

    def push(
        self, weights: Iterable[tuple[str, torch.Tensor]], target: RolloutBackend, version: int
    ) -> SyncReport: ...

    def close(self) -> None: ...

    # Optional: ``finalize(target, report) -> SyncReport``, called after core resumed the backend
    # (KV cache restored, prefix cache reset, generation resumed). A verification that needs the
    # engine to generate (probe log-probs) belongs here; it raises WeightSyncError on a mismatch.
