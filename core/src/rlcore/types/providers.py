"""Provider descriptors and the declarations plugins make.

What a provider hook returns (:class:`ProviderSpec` and one subclass per provider hook), the
capabilities providers declare (:class:`Cap`), a plugin's own config section
(:class:`PluginSettings`), its constraints, and what a provider factory receives
(:class:`BuildContext`). Import these from :mod:`rlcore.types`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from rlcore.types.forward import TrainingEngine

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
    #: in the train phase takes :attr:`HeadInput.loss` (the per-token objective) and returns
    #: :attr:`HeadOutput.loss` with the hidden-state and weight gradients formed inside the head
    FUSED_LOSS = "fused_loss"
    #: returns :attr:`HeadOutput.sum_pi_squared` (``Σ_v π(v)²`` per token) when asked
    SUM_PI_SQUARED = "sum_pi_squared"

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
    #: can run as a rollout replica: built from the run's config alone in a process of its own
    #: (a launcher's replica actor), without the trainer's engine
    REPLICA = "replica"
    #: loads a push by staging a copy of each tensor first (a lent storage may be read while it loads)
    STAGED_LOAD = "staged_load"
    #: can load a push into its live weights as the buckets arrive (``rollout.local_update: in_place``)
    IN_PLACE_LOAD = "in_place_load"
    #: drafts speculatively with the pushed policy's own first ``rollout.draft_depths`` MTP layers
    POLICY_MTP_DRAFTS = "policy_mtp_drafts"
    #: applies delta pushes (``sync.delta``): ``begin_delta(version, base_version, unchanged)`` and
    #: encoded tensors (:mod:`rlcore.delta`), refusing one whose base it does not hold (declared by
    #: a launcher: the fleet of its replicas forwards them)
    RECEIVE_DELTAS = "receive_deltas"
    #: takes LoRA adapter pushes (``lora.push``): the adapter's tensors in PEFT's names over the base
    #: it started from (:mod:`rlcore.lora`), not full weights
    RECEIVE_ADAPTERS = "receive_adapters"
    #: loads pushed MTP layers in any model's layout (core's local backend builds them only in
    #: MiMo's layout over Qwen2, so it does not declare this)
    ANY_MTP_LAYOUT = "any_mtp_layout"

    # weight_sync
    VERIFIED = "verified"  #: every push is verified against what the receiver holds
    BUCKETED = "bucketed"  #: moves flattened buckets, not one call per tensor
    ATOMIC = "atomic"  #: a failed push leaves the receiver on its previous version
    CUDA_IPC = "cuda_ipc"
    NCCL = "nccl"
    DRAFT_PHASE = "draft_phase"  #: also updates a speculative draft model (MTP)
    #: can push into a fleet of rollout replicas in other processes (a launcher's replicas)
    FEEDS_REPLICAS = "feeds_replicas"
    #: lends the writer's parameter storages to colocated replicas instead of copying them out
    LENDS_STORAGE = "lends_storage"
    #: can push only what changed since the receiver's version (``sync.delta``), verified as a full push
    DELTA = "delta"

    # engine
    PACKED_THD = "packed_thd"  #: runs packed sequences without padding
    MOE = "moe"
    MTP = "mtp"
    ROUTER_HOOK = "router_hook"  #: consults the router_hook chain in every MoE router
    RECORD_ROUTES = "record_routes"
    #: ranks each hold the whole model and split the step's samples (gradients summed over ranks)
    DATA_PARALLEL = "data_parallel"
    TENSOR_PARALLEL = "tensor_parallel"
    EXPERT_PARALLEL = "expert_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    #: ``engine.make_value_model()`` builds a critic (:class:`rlcore.types.value.ValueModel`) for PPO
    VALUE_MODEL = "value_model"
    #: ``export_weights()`` yields the engine's own parameters (not copies gathered over ranks),
    #: so a sync may lend their storages
    EXPORTS_OWN_PARAMETERS = "exports_own_parameters"
    #: builds its model from core's ``engine.model`` (an HF directory or the tiny config), so core's
    #: preflight measures that model; an engine without it takes its model from its own settings
    ENGINE_MODEL = "engine_model"
    #: trains LoRA adapters on a frozen base (``lora.rank`` > 0, :mod:`rlcore.lora`): the optimizer over
    #: the adapters, the reference is the base with adapters off, ``export_adapter()`` yields them
    LORA = "lora"
    #: builds MTP layers over an MoE model (``engine.model.tiny.mtp_layers`` on ``qwen2_moe``/``qwen3_moe``)
    MOE_MTP = "moe_mtp"

    # launcher (declared by the launcher ``cluster.backend`` selects; core copies them into the
    # resolved config's ``cluster.launcher_capabilities``, so that a plugin's config check and
    # factory can ask, by capability, where the ranks and replicas run)
    #: starts the trainer ranks itself, sized by ``cluster.trainer`` (dp/tp/ep/pp): an engine's own
    #: parallel sizes are then those (rlcore-megatron reads them instead of its keys)
    PLACES_RANKS = "places_ranks"
    #: runs each rollout backend as replicas in processes of their own (``cluster.rollout.replicas``)
    ROLLOUT_REPLICAS = "rollout_replicas"


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
    #: how many of a hook's providers one config selects: ``"one"`` (a name:
    #: :meth:`rlcore.manager.PluginManager.select`) or ``"many"`` (a list of names, every one of
    #: which runs: :meth:`~rlcore.manager.PluginManager.select_all`); a property of the role, so
    #: it is the descriptor's class that says it, never an instance
    selects: ClassVar[Literal["one", "many"]] = "one"

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
class PlatformSpec(ProviderSpec):
    """A device platform: ``factory(ctx: BuildContext) -> Platform``, selected by the device type
    of ``engine.device`` (``cpu``, ``cuda``, ``npu``, ``cuda:1``; ``auto`` picks the one available
    accelerator, else ``cpu``).

    ``device_type`` is torch's device type (``torch.device(device_type)``); ``dist_backend`` the
    torch.distributed backend its ranks use (``gloo``, ``nccl``, ``hccl``). ``is_available`` must
    be cheap and import nothing heavy (``importlib.util.find_spec``, ``torch.cuda.is_available``):
    it answers ``auto`` and ``rlcore check``. The factory *activates* the platform: it is the one
    place a vendor extension (``torch_npu``) may be imported, and it raises
    :class:`rlcore.errors.ConfigError` naming the install line when the extension is missing.
    """

    device_type: str = ""
    dist_backend: str = "gloo"
    is_available: Callable[[], bool] | None = None
    kind: str = field(default="platform", init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.device_type:
            object.__setattr__(self, "device_type", self.name)

    def available(self) -> bool:
        return True if self.is_available is None else bool(self.is_available())


@dataclass(frozen=True)
class LauncherSpec(ProviderSpec):
    """Where a run's trainer ranks and rollout replicas run: ``factory(config) -> Launcher``,
    selected by ``cluster.backend`` (built-in ``local``: this process; ``ray`` from rlcore-ray).

    The factory gets the resolved run config and must stay cheap (no cluster client import):
    ``rlcore check`` calls it to check the stack. ``remote_ranks`` (optional, cheap):
    ``remote_ranks(config) -> bool``, true when the ranks run on other machines (a cluster
    joined by address), so this machine's devices are not checked for them.
    """

    remote_ranks: Callable[[Any], bool] | None = None
    kind: str = field(default="launcher", init=False, repr=False)

    def ranks_are_remote(self, config: Any) -> bool:
        return bool(self.remote_ranks(config)) if self.remote_ranks is not None else False


@dataclass(frozen=True)
class TrackerSpec(ProviderSpec):
    """An experiment tracker: ``factory(run_dir: Path, config, versions: dict[str, str]) -> Tracker``,
    selected **many at a time**: every name in ``tracking.backends`` runs side by side (built-in
    ``tensorboard``, ``mlflow``, ``wandb``, ``trackio``; docs/tracking.md).

    The factory runs once per run on the writer rank, before the first step, with the run directory,
    the resolved config (an omegaconf ``DictConfig``) and the versions of Python, rlcore, torch,
    transformers and the active plugins; it does the tracker package's import itself and logs the
    config, the versions and the run directory. ``requires``: the modules the factory imports,
    looked up (never imported) when the config is resolved, so that a missing one is a
    :class:`rlcore.errors.ConfigError` naming ``install`` (the pip line that brings them) before the
    run starts.
    """

    requires: tuple[str, ...] = ()
    install: str = ""
    kind: str = field(default="tracker", init=False, repr=False)
    selects: ClassVar[Literal["one", "many"]] = "many"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "requires", tuple(self.requires))


@runtime_checkable
class Tracker(Protocol):
    """What a :class:`TrackerSpec`'s factory returns. ``log(step, metrics)`` after every step with
    the step's finite numeric metrics (what metrics.jsonl holds for the step, less text and
    non-finite values); ``close()`` once at the end of the run, completed or not. An exception from
    either is warned about once (:class:`rlcore.tracking.TrackerWarning`, naming the tracker) and the
    tracker is not called again: the run goes on and metrics.jsonl stays complete."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Launcher(Protocol):
    """What a :class:`LauncherSpec`'s factory returns (``rlcore train`` and ``rlcore check`` call it).

    ``check(stack)``: config-time checks against the selected providers' capabilities (a
    data-parallel size needs an engine that declares ``data_parallel``), raising
    :class:`rlcore.errors.ConfigError` naming the key; stack resolution calls it, so ``rlcore
    check`` reports what training would refuse. ``describe(stack)``: one line for ``rlcore
    check``. ``train(stack, ...)``: run the training; returns the writer rank's run summary (the
    dict :meth:`rlcore.trainer.Trainer.run` returns).
    """

    def check(self, stack: Any) -> None: ...

    def describe(self, stack: Any) -> str: ...

    def train(self, stack: Any, *, resume: bool = False, overwrite: bool = False,
              allow_config_change: bool = False, console: Any = None) -> dict[str, Any]: ...


@runtime_checkable
class Platform(Protocol):
    """What an activated platform offers core and engines (``rlcore.platforms``)."""

    device_type: str
    dist_backend: str

    def device(self, index: int | None = None) -> Any: ...  # a torch.device

    def device_count(self) -> int: ...

    def set_device(self, index: int) -> None: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class PluginSettings:
    """A plugin's own config section: ``section`` is the top-level YAML key, ``schema`` an
    omegaconf-compatible dataclass whose defaults are the plugin's defaults. ``validate``
    (optional) checks values types cannot express; it gets the merged section (and, when it
    takes a second argument, the whole resolved config, for checks that depend on other
    sections such as ``engine.device``) and raises :class:`rlcore.errors.ConfigError` naming the
    key. ``rlcore check`` runs it: whatever the plugin's factories would refuse at build time
    belongs here, so that a config is refused before anything is built. ``affects_training``:
    false for a section that only says where the run's processes run (a launcher's): it stays out
    of the training fingerprint, so ``--resume`` accepts a change to it without
    ``--allow-config-change``, as it does for core's ``cluster:`` section."""

    section: str
    schema: type
    plugin: str | None = None
    validate: Callable[[Any], None] | None = None
    affects_training: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "section", normalise_name(self.section).replace("-", "_"))


@dataclass(frozen=True)
class IncompatibleWith:
    """Declared by a plugin: it cannot be active together with plugin ``plugin``."""

    plugin: str
    reason: str


@dataclass(frozen=True)
class RequiresCapability:
    """Declared by a plugin: while it is active, the provider selected for ``role`` (any role
    that selects one provider: ``forward_fn``, ``rollout_backend``, ``weight_sync``, ``engine``,
    ``algorithm``, ``platform``, ``launcher``, ``environment``; :data:`rlcore.hookspecs.ROLES`)
    must declare ``capability``. ``when`` optionally limits the rule to configs where it returns
    True; ``reason`` may be a function of the config, to name the setting and its value."""

    role: str
    capability: str
    reason: str | Callable[[Any], str]
    when: Callable[[Any], bool] | None = None


Constraint = IncompatibleWith | RequiresCapability


@dataclass
class BuildContext:
    """What a provider factory receives.

    ``config`` is the whole resolved run config (an omegaconf ``DictConfig``); ``settings`` is
    the providing plugin's own section (or ``None``); ``output_dir`` is where the run writes;
    ``engine`` is the training engine once built (weight syncs and backends may need its model
    info, e.g. the route layout) and ``engine_capabilities`` what its descriptor declares;
    ``device`` / ``platform`` where it runs.
    """

    config: Any
    settings: Any = None
    output_dir: str | None = None
    engine: TrainingEngine | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    #: the run's device (a ``torch.device``) and the activated :class:`Platform` it belongs to,
    #: resolved by core from ``engine.device`` through the ``platform`` providers (``None`` when
    #: a factory is called outside a run: :func:`rlcore.platforms.resolve_device` then)
    device: Any = None
    platform: Platform | None = None
    #: what the training engine's descriptor declares (``Cap`` values), once the engine is built:
    #: a sync may lend storages only from an engine that declares ``exports_own_parameters``
    engine_capabilities: frozenset[str] = frozenset()
