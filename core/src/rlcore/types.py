"""The typed contracts between rlcore and its plugins.

Everything a plugin receives from or returns to core is defined here: the descriptors that
provider hooks return, the inputs and outputs of each provider's instance, and the contexts the
chain hooks get. This module imports no engine and not even torch at runtime (tensors appear
only in annotations), so ``rlcore plugins`` stays fast.

Conventions used throughout (see docs/architecture.md):

* **Token axis.** A step's samples are packed THD-style into one flat token axis of length ``T``
  (:class:`rlcore.batch.PackedBatch`). Every per-token tensor has ``T`` as its first dimension.
* **Label alignment.** Position ``t`` predicts token ``t + 1`` of the same sequence. Per-token
  quantities about a *target* token (log-probs, advantages, the loss mask) live at the position
  that predicts it. Routed experts live at the position whose forward pass chose them.
* **Routes.** Routed experts are ``[tokens, routed_layers, topk]`` int16, ``-1`` where a token
  has no route (padding, the last token of a sequence). ``routed_layers`` follows
  :class:`RouteLayout`: decoder MoE layers in ascending layer index, then MTP layers.
* **Vocab sharding.** The LM-head weight a forward_fn receives may be this rank's rows of a
  vocab-parallel weight; :class:`VocabShard` says which global ids it holds and which of them
  are padding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterable,
    Iterator,
    Literal,
    Mapping,
    Protocol,
    Sequence,
    runtime_checkable,
)

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch
    import torch.distributed

    from rlcore.batch import PackedBatch

PLUGIN_API = 1
"""The integer version of the plugin contract. A plugin module declares the API it was built for
as a module attribute ``PLUGIN_API``; core refuses a plugin built for another one. Adding an
argument to a hook or a field to a dataclass here does not change it; removing or renaming one
does."""

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def normalise_name(name: str) -> str:
    """Provider and plugin names are lower-case identifiers (``fused``, ``vllm``, ``sglang-nccl``)."""
    if not isinstance(name, str):
        raise TypeError(f"a provider name must be a str, got {type(name).__name__}")
    norm = name.strip().lower()
    if not _NAME_RE.match(norm):
        raise ValueError(
            f"invalid provider name {name!r}: use lower-case letters, digits, '-', '_' or '.'"
        )
    return norm


# --------------------------------------------------------------------------------------------
# Capabilities
# --------------------------------------------------------------------------------------------


class Cap:
    """Named capabilities that providers declare and features require.

    A capability a provider does not declare is a capability it does not have: core never
    assumes one, and a feature that needs it fails before training starts (``rlcore check``
    reports the gap). Runtime capabilities (:meth:`RolloutBackend.capabilities`) may be fewer
    than the declared ones, e.g. vLLM on CPU cannot sleep.
    """

    # forward_fn
    ENTROPY = "entropy"  #: returns entropy (and its gradient)
    PER_TOKEN_TEMPERATURE = "per_token_temperature"  #: temperature may be a [T] tensor
    VOCAB_PARALLEL = "vocab_parallel"  #: handles a vocab-sharded weight over a TP group
    SEQUENCE_PARALLEL = "sequence_parallel"  #: accepts sequence-parallel hidden states
    MASK_SKIPS_COMPUTE = "mask_skips_compute"  #: masked tokens cost no FLOPs

    # rollout_backend
    LOGPROBS = "logprobs"  #: behaviour log-probs of sampled tokens (processed)
    ROUTED_EXPERTS = "routed_experts"  #: returns routed experts per token (R3)
    PAUSE = "pause"  #: pause/resume generation
    RELEASE_KV_CACHE = "release_kv_cache"  #: frees/restores the KV cache around a push
    RELEASE_WEIGHTS = "release_weights"  #: offloads/restores weights (colocated training)
    PREFIX_CACHE_RESET = "prefix_cache_reset"
    SPECULATIVE = "speculative"  #: speculative decoding (MTP/EAGLE drafts)
    RECEIVE_BUCKETS = "receive_buckets"  #: implements :class:`BucketReceiver` (inproc sync)
    RECEIVE_DISK = "receive_disk"  #: implements :class:`DiskReceiver` (disk sync)
    WEIGHT_CHECKSUMS = "weight_checksums"  #: can report checksums of the weights it holds

    # weight_sync
    VERIFIED = "verified"  #: every push is verified against what the receiver holds
    BUCKETED = "bucketed"  #: moves flattened buckets, not one call per tensor
    ATOMIC = "atomic"  #: a failed push leaves the receiver on its previous version
    CUDA_IPC = "cuda_ipc"
    NCCL = "nccl"
    DRAFT_PHASE = "draft_phase"  #: also updates a speculative draft model (MTP)

    # engine
    PACKED_THD = "packed_thd"  #: runs packed sequences without padding
    MOE = "moe"
    MTP = "mtp"
    ROUTER_HOOK = "router_hook"  #: consults the router_hook chain in every MoE router
    RECORD_ROUTES = "record_routes"
    TENSOR_PARALLEL = "tensor_parallel"
    EXPERT_PARALLEL = "expert_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"


# --------------------------------------------------------------------------------------------
# Descriptors returned by provider hooks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProviderSpec:
    """A named implementation that a provider hook registers.

    ``factory`` builds the implementation when the config selects ``name``; it must do all
    heavy imports (engines, Triton) itself so that listing plugins stays cheap.
    ``distribution`` and ``plugin`` are filled in by the plugin manager from the entry point
    that registered the plugin; a plugin leaves them unset.
    """

    name: str
    factory: Callable[..., Any]
    capabilities: frozenset[str] = frozenset()
    description: str = ""
    distribution: str | None = None
    plugin: str | None = None
    #: optional, cheap (no engine import): ``platform_gaps(config) -> {capability: reason}`` for
    #: declared capabilities this machine or config cannot deliver (vLLM's CPU build cannot
    #: sleep). ``rlcore check`` reports them and core refuses configs that need them.
    platform_gaps: Callable[[Any], Mapping[str, str]] | None = None

    kind: str = field(default="provider", init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalise_name(self.name))
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        if not callable(self.factory):
            raise TypeError(f"{type(self).__name__}({self.name!r}).factory must be callable")

    def source(self) -> str:
        """``dist version`` (or the plugin name) for error messages."""
        return self.distribution or self.plugin or "<unregistered>"

    def gaps(self, config: Any) -> dict[str, str]:
        """Declared capabilities unavailable here, with reasons (see ``platform_gaps``)."""
        if self.platform_gaps is None:
            return {}
        return {str(k): str(v) for k, v in dict(self.platform_gaps(config)).items() if k in self.capabilities}

    def effective_capabilities(self, config: Any) -> frozenset[str]:
        return self.capabilities - frozenset(self.gaps(config))


@dataclass(frozen=True)
class ForwardFnSpec(ProviderSpec):
    """A policy head: ``factory(ctx: BuildContext) -> ForwardFn``."""

    kind: str = field(default="forward_fn", init=False, repr=False)


@dataclass(frozen=True)
class RolloutBackendSpec(ProviderSpec):
    """A sampler: ``factory(ctx: BuildContext) -> RolloutBackend``."""

    kind: str = field(default="rollout_backend", init=False, repr=False)


@dataclass(frozen=True)
class WeightSyncSpec(ProviderSpec):
    """A trainer→rollout weight transport: ``factory(ctx: BuildContext) -> WeightSync``.

    ``requires_backend`` lists capabilities the selected rollout backend must declare (an
    ``inproc`` push needs ``receive_buckets``); ``backends`` restricts the backends it can feed
    by name (``None`` = any backend with the required capabilities).
    """

    requires_backend: frozenset[str] = frozenset()
    backends: frozenset[str] | None = None
    kind: str = field(default="weight_sync", init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "requires_backend", frozenset(self.requires_backend))
        if self.backends is not None:
            object.__setattr__(self, "backends", frozenset(map(normalise_name, self.backends)))


@dataclass(frozen=True)
class EngineSpec(ProviderSpec):
    """A training engine: ``factory(ctx: BuildContext) -> TrainingEngine``."""

    kind: str = field(default="engine", init=False, repr=False)


@dataclass(frozen=True)
class PluginSettings:
    """A plugin's own config section: ``section`` is the top-level YAML key, ``schema`` an
    omegaconf-compatible dataclass whose defaults are the plugin's defaults. ``validate``
    (optional) checks values types cannot express; it gets the merged section and raises
    :class:`rlcore.errors.ConfigError` naming the key (``rlcore check`` runs it)."""

    section: str
    schema: type
    plugin: str | None = None
    validate: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "section", normalise_name(self.section).replace("-", "_"))


@dataclass(frozen=True)
class IncompatibleWith:
    """Declared by a plugin: it cannot be active together with plugin ``plugin``."""

    plugin: str
    reason: str


@dataclass(frozen=True)
class RequiresCapability:
    """Declared by a plugin: while it is active, the provider selected for ``role``
    (``forward_fn``, ``rollout_backend``, ``weight_sync`` or ``engine``) must declare
    ``capability``. ``when`` optionally limits the rule to configs where it returns True."""

    role: Literal["forward_fn", "rollout_backend", "weight_sync", "engine"]
    capability: str
    reason: str
    when: Callable[[Any], bool] | None = None


Constraint = IncompatibleWith | RequiresCapability


@dataclass
class BuildContext:
    """What a provider factory receives.

    ``config`` is the whole resolved run config (an omegaconf ``DictConfig``); ``settings`` is
    the providing plugin's own section (or ``None``); ``output_dir`` is where the run writes;
    ``engine`` is the training engine once built (weight syncs and backends may need its model
    info, e.g. the route layout).
    """

    config: Any
    settings: Any = None
    output_dir: str | None = None
    engine: TrainingEngine | None = None
    extras: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# forward_fn: the policy head
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VocabShard:
    """Which global vocabulary ids the LM-head weight on this rank holds.

    The weight passed to a forward_fn has ``end - start`` rows, for global ids
    ``[start, end)``. Ids ``>= vocab_size`` are padding rows (Megatron pads the vocab to a
    multiple of 128·TP): a forward_fn must exclude them from the softmax. ``group`` is the
    tensor-parallel process group the vocab is sharded over (``None`` when unsharded); under
    sharding every rank's statistics must be combined before log-probs are final.
    """

    start: int
    end: int
    vocab_size: int
    group: Any = None

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def valid_rows(self) -> int:
        """Rows of this shard that are real vocabulary entries (not padding)."""
        return max(0, min(self.end, self.vocab_size) - self.start)

    @classmethod
    def full(cls, vocab_size: int, rows: int | None = None) -> VocabShard:
        """The unsharded case: one rank holds all ``rows`` (>= vocab_size) rows."""
        return cls(0, vocab_size if rows is None else rows, vocab_size, None)


@dataclass
class HeadInput:
    """The inputs of a forward_fn call (one micro-batch).

    * ``hidden``: final hidden states ``[T, H]`` (``[T / tp, H]`` when ``sequence_parallel``),
      any float dtype; the head computes in fp32.
    * ``weight``: LM-head rows ``[V_local, H]`` (see ``vocab``), same dtype as ``hidden``.
    * ``labels``: ``[T]`` int64 global token ids (the token each position predicts); any value
      where ``loss_mask`` is False.
    * ``loss_mask``: ``[T]`` bool; positions that are False get log-prob 0 and entropy 0 and
      must not contribute gradient. ``None`` means every position counts.
    * ``temperature``: a float, or a ``[T]`` float tensor (needs ``per_token_temperature``).
      Logits are divided by it before the softmax, as the rollout engine did.
    * ``sequence_parallel``: hidden states are split over the TP group along T; the head
      gathers them (and reduce-scatters their gradient).
    * ``compute_entropy``: whether the entropy output is needed.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    vocab: VocabShard
    loss_mask: torch.Tensor | None = None
    temperature: float | torch.Tensor = 1.0
    sequence_parallel: bool = False
    compute_entropy: bool = True


@dataclass
class HeadOutput:
    """``logprobs`` and ``entropy`` are ``[T]`` float32 (full T, also under sequence
    parallelism), 0 at masked positions, differentiable w.r.t. hidden and weight."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


@runtime_checkable
class ForwardFn(Protocol):
    """A policy head built by a :class:`ForwardFnSpec` factory."""

    def __call__(self, inp: HeadInput) -> HeadOutput: ...


# --------------------------------------------------------------------------------------------
# Training engines
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteLayout:
    """The order of the routed-layer axis of every route tensor.

    ``layers`` are 0-based decoder layer indices of the MoE layers, ascending, followed by
    ``num_hidden_layers + d`` for MTP depth ``d`` when MTP routers are recorded. Rollout
    engines report routes for every hidden layer; :meth:`select` keeps the MoE ones.
    """

    layers: tuple[int, ...]
    topk: int
    num_experts: int
    num_hidden_layers: int

    @property
    def num_routed(self) -> int:
        return len(self.layers)

    def index_of(self, layer: int) -> int:
        return self.layers.index(layer)

    def select(self, routes_all_layers: torch.Tensor) -> torch.Tensor:
        """``[N, num_hidden_layers(+mtp), K]`` → ``[N, len(layers), K]`` in layout order.

        Rollout engines report the decoder layers only; MTP columns they lack are filled with
        -1 (route natively)."""
        if routes_all_layers.dim() != 3 or routes_all_layers.shape[2] != self.topk:
            raise ValueError(
                f"routes must be [tokens, layers, topk={self.topk}], got {tuple(routes_all_layers.shape)}"
            )
        have = routes_all_layers.shape[1]
        if have == self.num_routed:
            return routes_all_layers
        decoder = [layer for layer in self.layers if layer < self.num_hidden_layers]
        if decoder and have < max(decoder) + 1:
            raise ValueError(f"routes have {have} layers; layout needs decoder layer {max(decoder)}")
        cols = []
        for layer in self.layers:
            if layer < have:
                cols.append(routes_all_layers[:, layer, :])
            else:  # an MTP router the rollout engine did not report
                cols.append(routes_all_layers.new_full((routes_all_layers.shape[0], self.topk), -1))
        import torch  # only here: this module stays importable without torch

        return torch.stack(cols, dim=1)


@dataclass(frozen=True)
class ModelInfo:
    """What core and plugins need to know about the policy model."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    eos_token_id: int | None = None
    pad_token_id: int = 0
    route_layout: RouteLayout | None = None  #: None for dense models
    mtp_layers: int = 0
    architecture: str = ""


@dataclass
class RouterCall:
    """What an MoE router asks the router_hook chain.

    ``layer`` is the layer's id in :class:`RouteLayout` order terms (0-based decoder layer
    index; ``num_hidden_layers + d`` for MTP depth ``d``) and ``routed_index`` its position on
    the routed-layer axis. ``token_offset``/``num_tokens`` say which rows of the micro-batch's
    token axis this router sees (sequence parallelism splits them). ``scores`` are the router's
    pre-top-k scores ``[num_tokens, num_experts]`` when the engine consults the chain inside
    the router, or ``None`` when it asks ahead of the forward (native Megatron RouterReplay).
    ``recompute`` is True during activation recomputation in backward.
    """

    layer: int
    routed_index: int
    is_mtp: bool
    num_experts: int
    topk: int
    token_offset: int
    num_tokens: int
    micro_batch: MicroBatchContext | None
    scores: torch.Tensor | None = None
    recompute: bool = False


@dataclass
class RouterDecision:
    """The experts a router must use: ``indices`` ``[num_tokens, topk]`` int64, one row per
    token of the :class:`RouterCall`. Rows with a negative index are routed natively (e.g. the
    last token of a sequence, which the rollout engine never routed)."""

    indices: torch.Tensor


@dataclass
class EngineOutput:
    """A training engine's body forward over one micro-batch.

    ``hidden``: final hidden states ``[T, H]`` (``[T/tp, H]`` under sequence parallelism),
    after the final norm. ``mtp_hidden``: one ``[T, H]`` per MTP depth (depth d predicts token
    ``t + 1 + d``), or None. ``routes``: the experts every router chose, ``[T, routed_layers,
    topk]`` int16 in :class:`RouteLayout` order, when routes were requested. ``aux_losses``:
    scalar terms the engine adds itself (MoE load balancing), already scaled.
    """

    hidden: torch.Tensor
    mtp_hidden: list[torch.Tensor] | None = None
    routes: torch.Tensor | None = None
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    sequence_parallel: bool = False


@dataclass
class HeadWeight:
    """The LM-head weight as the forward_fn needs it (this rank's rows, tied or not)."""

    weight: torch.Tensor
    vocab: VocabShard


@runtime_checkable
class TrainingEngine(Protocol):
    """Runs the policy body on packed batches, owns its parameters and exports HF weights."""

    info: ModelInfo

    def forward(
        self,
        batch: PackedBatch,
        *,
        record_routes: bool = False,
        router: RouterDispatch | None = None,
        micro_batch: MicroBatchContext | None = None,
        mtp_hidden: bool = False,
    ) -> EngineOutput:
        """Body forward of one micro-batch to final hidden states. ``record_routes``: fill
        ``EngineOutput.routes``; ``router``: consult it in every MoE router; ``mtp_hidden``:
        also return MTP hidden states (engines with MTP layers)."""
        ...

    def head(self) -> HeadWeight: ...

    def parameters(self) -> Iterator[torch.Tensor]: ...

    def setup_optimizer(self, training: Any) -> None:
        """Create the optimizer from the ``training`` config section (the engine owns it, so a
        distributed engine can shard it)."""
        ...

    def zero_grad(self) -> None: ...

    def optimizer_step(self, grad_clip: float) -> float:
        """Clip (total norm over every rank's shard), step, and return the grad norm."""
        ...

    def make_reference(self) -> TrainingEngine:
        """A frozen copy of the current policy (reference for the KL penalty)."""
        ...

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full tensor)`` one tensor at a time (TP/EP gathered per tensor)."""
        ...

    def save_hf(self, path: str) -> None:
        """Write an HF-format model directory (config, tokenizer, safetensors) that rollout
        engines can start from."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def train(self, mode: bool = True) -> Any: ...


class RouterDispatch(Protocol):
    """Given to an engine's forward: ask the router_hook chain, first answer wins."""

    def __call__(self, call: RouterCall) -> RouterDecision | None: ...


# --------------------------------------------------------------------------------------------
# postprocess / step_end chains
# --------------------------------------------------------------------------------------------

Phase = Literal["old_logprob", "ref_logprob", "train"]


@dataclass
class MicroBatchContext:
    """Where a micro-batch forward stands. ``phase`` is ``old_logprob`` (the no-grad pass that
    recomputes the policy's log-probs, where R2 records routes), ``ref_logprob`` (the reference
    policy for KL) or ``train`` (the gradient pass). ``index``/``count`` number the micro-batches
    of this phase; ``pipeline_stage``/``virtual_stage`` are set by pipelined engines."""

    step: int
    phase: Phase
    index: int
    count: int
    batch: PackedBatch
    config: Any = None
    pipeline_stage: int = 0
    virtual_stage: int | None = None
    num_tokens_in_step: int = 0  #: loss-mask tokens across all micro-batches of the step


@dataclass
class ForwardRequest:
    """Extra outputs a plugin wants from a micro-batch forward (``forward_request`` hook)."""

    record_routes: bool = False
    mtp_hidden: bool = False

    def merge(self, other: ForwardRequest | None) -> ForwardRequest:
        if other is None:
            return self
        return ForwardRequest(
            record_routes=self.record_routes or other.record_routes,
            mtp_hidden=self.mtp_hidden or other.mtp_hidden,
        )


@dataclass
class ModelOutput:
    """What the postprocess chain sees after a micro-batch forward."""

    engine: EngineOutput
    head: HeadOutput
    head_weight: HeadWeight
    forward_fn: ForwardFn


@dataclass
class PostprocessResult:
    """What a postprocess implementation returns.

    ``loss_terms``: scalar tensors added to this micro-batch's loss (already weighted; name
    them, they are logged). ``metrics``: floats averaged over micro-batches and logged.
    ``batch_updates``: per-token tensors ``[T, ...]`` written into the step's batch fields
    under their keys, e.g. routes recorded during ``old_logprob`` for R2 replay.
    """

    loss_terms: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    batch_updates: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepContext:
    """End of a training step (after the optimizer step, before the weight push)."""

    step: int
    batch: PackedBatch
    metrics: dict[str, float]
    config: Any = None


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
    held when it produced the sample. ``weight_versions``: when the engine's weights changed
    while it generated the sample, ``((version, first_response_index), ...)`` in order: response
    tokens from ``first_response_index`` on came from ``version``. ``routed_experts``:
    ``[P + R - 1, num_hidden_layers, topk]`` ints in the engine's layer order (every token but
    the last), or None.
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


__all__ = [name for name in dir() if not name.startswith("_")]
