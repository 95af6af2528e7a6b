"""The run config: an omegaconf structured schema, extended by each active plugin's section.

Loading is two-staged because plugins contribute schema: the YAML (plus command-line dotlist
overrides such as ``rollout.n=8``) is read once untyped to learn ``plugins:``, those plugins are
activated, and then the whole document is validated against :class:`RunConfig` extended with a
field per plugin section. Unknown keys and values of the wrong type are :class:`ConfigError`\\ s
that name the full key.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from rlcore.algorithm_settings import DapoConfig, KLControlConfig, MismatchConfig, check_modifiers
from rlcore.algorithms.spec import KL_ESTIMATORS, LOSS_AGGREGATIONS
from rlcore.cluster_settings import ClusterConfig, check_cluster, resolve_seed_per_prompt
from rlcore.datasets.files import OVERLONG_CHOICES, check_data_files
from rlcore.environment_settings import EnvironmentConfig, check_environment
from rlcore.errors import ConfigError, ConfigErrors, closest_name
from rlcore.loop_settings import LoopConfig, check_loop
from rlcore.lora import LORA_PUSH_MODES, LoraSettings, check_lora
from rlcore.model_settings import ATTENTION_CHOICES, check_model
from rlcore.rollout_settings import LOCAL_UPDATE_MODES, check_local_rollout
from rlcore.tracking.settings import (
    MlflowSettings,
    TensorBoardSettings,
    TrackioSettings,
    WandbSettings,
    check_tracking,
)
from rlcore.types.providers import Cap
from rlcore.validation import check_validation


@dataclass
class TinyModelConfig:
    """A small model created locally from a config (no model hub). ``arch``: ``qwen2`` (dense),
    ``qwen2_moe`` (shared expert) or ``qwen3_moe``. ``vocab_size`` 0 = the tokenizer's size."""

    arch: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    num_experts: int = 8
    topk: int = 2
    moe_intermediate_size: int = 64
    mtp_layers: int = 0
    vocab_size: int = 0
    init_std: float = 0.08
    tie_word_embeddings: bool = False
    seed: int = 0


@dataclass
class ModelConfig:
    """``path``: an HF model directory; when empty a tiny model is created from ``tiny`` (and a
    tokenizer is built locally for the task)."""

    path: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: str = "float32"


@dataclass
class EngineConfig:
    """``attention`` (``hf`` engine): ``padded`` rows, ``packed`` sequences without padding
    (per-sequence attention over ``cu_seqlens``), or ``auto`` (packed where torch's varlen kernel
    runs: CUDA, bf16/fp16; :mod:`rlcore.engines.hf`)."""

    name: str = "hf"
    device: str = "cpu"
    attention: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class ForwardConfig:
    """The head (forward_fn) and how the policy's log-probs are computed."""

    name: str = "reference"
    chunk_tokens: int = 2048


@dataclass
class RolloutConfig:
    """``release_kv_cache``: ``auto`` releases the KV cache around every weight push when the
    backend can and reports when it cannot; ``always`` makes a backend without the capability
    an error; ``never`` keeps it resident. ``seed``: what the sampling seeds derive from (each
    step samples with ``seed * 1_000_003 + step``, :func:`rlcore.rollout_seeds.step_seed`);
    unset, ``training.seed``. Changing it changes the samples only: prompts and the model's
    initialisation follow ``training.seed``. ``draft_depths`` (``local`` backend): sample
    speculatively with the model's first ``draft_depths`` MTP layers as the draft (0: off); the
    output distribution is unchanged (:mod:`rlcore.rollout_speculative`).
    ``seed_per_prompt``: each prompt's samples draw
    from a seed of their own (the step's seed and the prompt's index), so they do not depend on
    which prompts share a call, nor on how prompts are split across rollout replicas (local
    backend); unset, on exactly when ``cluster.rollout.replicas`` > 1.
    ``local_update`` (``local`` backend): ``staged`` (default) holds a push's whole new version
    apart and swaps it in at commit, so a failed push leaves the old version serving, at the cost
    of one more copy of the model on the rollout's device; ``in_place`` copies each bucket into the
    live weights as it arrives (no copy of the model: a push's extra memory is its buckets), and
    a push that fails part way leaves the rollout refusing to generate until a push completes."""

    backend: str = "local"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 4
    release_kv_cache: str = "auto"
    return_routed_experts: bool = False
    seed: int | None = None
    draft_depths: int = 0
    seed_per_prompt: bool | None = None
    local_update: str = "staged"


@dataclass
class SyncConfig:
    """The weight sync (hook ``weight_sync``). ``name``: the sync (``inproc``, ``disk``, a
    plugin's); ``bucket_mb``: the capacity of a bucket; ``verify``: check every push (``exact``:
    checksums of what the receiver holds after it equal the trainer's). ``delta`` (a sync that
    declares ``delta`` into a backend that declares ``receive_deltas``: ``inproc`` into ``local``):
    send only what changed since the version the receiver holds (rows or elements, each tensor as
    whichever is smallest; :mod:`rlcore.delta`), verified as a full push is; the sender keeps a copy
    of the model as last pushed, on the trainer's device. ``delta_max_ratio`` in (0, 1]: a push
    whose encoding would exceed this fraction of the full push's bytes is sent full instead.
    ``delta_full_every``: every N-th push is a full one (0: only when needed: the first push, after
    a failed one, when the receiver is not on the version the delta starts from)."""

    name: str = "inproc"
    bucket_mb: float = 64.0
    verify: bool = True
    delta: bool = False
    delta_max_ratio: float = 0.5
    delta_full_every: int = 20


@dataclass
class AlgorithmConfig:
    """Core's part of the ``algorithm:`` section; the selected algorithm provider (``name``,
    hook ``algorithm``) adds its own keys next to these (``clip_low``, ``clip_high`` ... for
    the built-ins; docs/algorithms.md lists them).

    ``loss_agg``: ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
    ``token-sum``, ``seq-mean-token-sum-norm`` (divides by ``norm_tokens``, 0 =
    ``rollout.max_new_tokens``) or ``auto`` (the algorithm's published choice). ``kl_coef``
    > 0 adds KL to a frozen copy of the initial policy (``kl_estimator`` k1/k2/k3), as a loss
    term (``kl_in: loss``) or as a per-token reward penalty (``kl_in: reward``).
    ``entropy_coef``: entropy bonus. ``old_logprobs``: the ratio's denominator, the rollout
    engine's log-probs (``rollout``), the trainer's recomputation in a no-grad pass before
    training (``recompute``), or the train forward's own log-probs, detached (``current``: with
    one update per step these are the recomputation's values, so that pass is skipped; the
    mismatch weights are then computed per token inside the loss, which needs a token-level
    correction); ``auto`` is ``recompute`` when ``mismatch`` corrects, else ``rollout``. ``updates_per_step``:
    optimizer steps over each step's batch (PPO epochs; metrics are the last update's).
    """

    name: str = "grpo"
    loss_agg: str = "auto"
    norm_tokens: int = 0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"
    entropy_coef: float = 0.0
    old_logprobs: str = "auto"
    updates_per_step: int = 1
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    kl_control: KLControlConfig = field(default_factory=KLControlConfig)  #: adaptive β (rlcore.algorithm_settings)
    dapo: DapoConfig = field(default_factory=DapoConfig)  #: rlcore.algorithm_settings


@dataclass
class TrainingConfig:
    """``on_nonfinite``: what a NaN/inf advantage, loss or gradient norm does. ``stop`` (the
    default) ends the run with an error naming the quantity; ``skip`` drops the step (no
    optimizer update, no push, the step is recorded in metrics.jsonl with ``skipped``). Either
    way the weights stay the last good ones. Non-finite rewards always stop the run."""

    steps: int = 150
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    seed: int = 0
    max_wall_seconds: float = 0.0  #: stop early after this many seconds (0 = no limit)
    on_nonfinite: str = "stop"


@dataclass
class DataConfig:
    """``task`` and ``reward`` are ``module:function`` paths. The task builds the tokenizer
    vocabulary and prompts; the reward scores a sample (see docs/tasks.md).
    ``train_files``: a path or a list of paths of prompt files (JSON lines, Parquet, ``datasets``
    save_to_disk directories; empty: the prompts come from ``task``), shuffled by
    ``training.seed`` epoch by epoch; ``val_files`` the same for validation (read and checked).
    ``prompt_key``: the column holding the prompt (a string, or a list of chat messages rendered
    with the tokenizer's chat template); ``answer_key``: the column whose value the reward gets as
    ``meta["answer"]`` (a dotted path reads a nested field: ``reward_model.ground_truth``; empty:
    none); every other column is in ``meta`` too. ``overlong``: a prompt longer than the context
    (the model's positions minus ``rollout.max_new_tokens``) is dropped (``filter``, counted) or
    refused (``error``). See docs/data.md.
    ``reward_timeout_seconds``: the longest one reward call may take before the run stops naming
    it (0 = no limit; rlcore/rewards.py). ``reward_by_source``: ``{data_source: module:function}``,
    the reward of each row by its ``meta["data_source"]``, read when ``reward`` is
    ``rlcore.scoring:by_data_source_reward`` (rlcore/scoring.py)."""

    task: str = "rlcore.tasks:successor"
    reward: str = "rlcore.tasks:successor_reward"
    prompts_per_step: int = 16
    prompt_len: int = 3
    train_files: Any = None  #: a path or a list of paths (rlcore.datasets)
    val_files: Any = None
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"  #: empty or null: no answer
    overlong: str = "filter"
    reward_timeout_seconds: float = 60.0
    reward_by_source: dict[str, str] = field(default_factory=dict)


@dataclass
class ValidationConfig:
    """Validation on ``data.val_files`` (rlcore.validation, docs/data.md "Validation"), through
    the run's rollout backend with the current weights, scored by ``data.reward``.
    ``every_steps``: validate before step 0, before every step that is a multiple of it, and after
    the last step (0 = off; needs ``data.val_files`` and ``loop.mode: sync``). ``val/accuracy`` is
    the mean reward of one greedy response per prompt; with ``n`` > 1, ``n`` samples per prompt at
    ``temperature`` (unset: ``rollout.temperature``) give ``val/pass@k`` (``k = n``, the unbiased
    estimator; a sample counts as correct when its reward is at least ``correct_threshold``) and
    ``val/mean@k`` (their mean reward). ``max_prompts``: the first that many validation prompts
    (0 = all). The sampled responses use a seed of their own: training is the same with or without
    validation."""

    every_steps: int = 0
    n: int = 1
    temperature: float | None = None
    correct_threshold: float = 1.0
    max_prompts: int = 0


@dataclass
class OutputConfig:
    """``checkpoint_every``: steps between checkpoints (0 = only at the end);
    ``keep_checkpoints``: how many of the newest good checkpoints stay on disk;
    ``export_hf``: the trained policy as a Hugging Face directory (rlcore/export.py) at each
    checkpoint and at the end (``checkpoints``), at the end only (``final``) or ``never``."""

    dir: str | None = None
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    export_hf: str = "checkpoints"
    #: TensorBoard event files whenever tensorboard is installed (a note when not): the ``tensorboard``
    #: tracker without listing it in ``tracking.backends``, as before trackers existed; false turns it off
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True


@dataclass
class TrackingConfig:
    """Experiment trackers (docs/tracking.md): every name in ``backends`` gets each step's metrics
    besides ``metrics.jsonl``, and the resolved config, versions and run directory once (built-in
    ``tensorboard``, ``mlflow``, ``wandb``, ``trackio``; a plugin adds more through the ``tracker``
    hook); each built-in's own settings are under its name (rlcore.tracking.settings). ``project``
    and ``run_name`` are every backend's project (MLflow: experiment) and run name unless its own
    section says otherwise; ``run_name`` defaults to the name of the run directory."""

    backends: list[str] = field(default_factory=list)
    project: str = "rlcore"
    run_name: str | None = None
    tensorboard: TensorBoardSettings = field(default_factory=TensorBoardSettings)
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    wandb: WandbSettings = field(default_factory=WandbSettings)
    trackio: TrackioSettings = field(default_factory=TrackioSettings)


@dataclass
class RunConfig:
    """The whole run. Each active plugin adds a top-level section of its own."""

    plugins: list[str] = field(default_factory=list)
    engine: EngineConfig = field(default_factory=EngineConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)  #: rlcore.validation
    output: OutputConfig = field(default_factory=OutputConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)  #: rlcore.loop_settings
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)  #: rlcore.environment_settings
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  #: rlcore.tracking
    lora: LoraSettings = field(default_factory=LoraSettings)  #: rlcore.lora


CORE_SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def read_raw(path: str | Path | None, overrides: Sequence[str] = ()) -> DictConfig:
    """The YAML merged with dotlist overrides, untyped (no schema yet)."""
    try:
        base = OmegaConf.load(path) if path else OmegaConf.create({})
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except Exception as exc:  # yaml errors
        raise ConfigError(f"cannot parse config {path}: {exc}") from exc
    if not isinstance(base, DictConfig):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    try:
        over = OmegaConf.from_dotlist(list(overrides))
    except Exception as exc:
        raise ConfigError(f"bad command-line override {list(overrides)}: {exc}") from exc
    return OmegaConf.merge(base, over)  # type: ignore[return-value]


def raw_plugins(raw: DictConfig) -> list[str]:
    plugins = raw.get("plugins", [])
    if plugins is None:
        return []
    if not isinstance(plugins, (ListConfig, list)):
        raise ConfigError(f"plugins: must be a list of plugin names, got {plugins!r}", key="plugins")
    return [str(p).strip().lower() for p in plugins]


def algorithm_schema(spec: Any) -> type:
    """:class:`AlgorithmConfig` extended with the selected algorithm's own settings."""
    own = getattr(spec, "settings", None)
    if own is None:
        return AlgorithmConfig
    if not dataclasses.is_dataclass(own):
        raise ConfigError(f"algorithm {spec.name!r} ({spec.source()}): its settings must be a dataclass")
    core = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    hints = typing.get_type_hints(own)
    extra = []
    for f in dataclasses.fields(own):
        if f.name in core:
            raise ConfigError(
                f"algorithm {spec.name!r} ({spec.source()}) declares setting {f.name!r}, which is one of core's "
                f"algorithm keys ({', '.join(sorted(core))})"
            )
        default = (field(default=f.default) if f.default is not dataclasses.MISSING
                   else field(default_factory=f.default_factory))  # type: ignore[arg-type]
        extra.append((f.name, hints[f.name], default))
    return dataclasses.make_dataclass(f"AlgorithmConfig_{spec.name.replace('-', '_').replace('.', '_')}", extra,
                                      bases=(AlgorithmConfig,))


def builtin_algorithms() -> dict[str, Any]:
    """Core's built-in algorithm specs (for validation without a plugin manager)."""
    from rlcore.builtin.algorithms import algorithm

    return {spec.name: spec for spec in algorithm()}


def builtin_environments() -> dict[str, Any]:
    """Core's built-in environment specs (for validation without a plugin manager)."""
    from rlcore.builtin.environments import environment

    return {spec.name: spec for spec in environment()}


def selected_algorithm(raw: DictConfig, algorithms: dict[str, Any]) -> Any:
    name = str(OmegaConf.select(raw, "algorithm.name", default="grpo") or "grpo").strip().lower()
    if name not in algorithms:
        raise ConfigError(
            f"algorithm.name: {name!r} is not a known algorithm. Choose one of: {', '.join(sorted(algorithms))} "
            f"(or install the plugin that provides it and add it to plugins:)",
            key="algorithm.name",
        )
    return algorithms[name]


def schema_with_plugins(settings: Sequence[Any], algorithm: Any) -> type:
    """:class:`RunConfig` extended with the selected algorithm's settings in ``algorithm:`` and one
    field per plugin section."""
    alg_cls = algorithm_schema(algorithm)
    extra = [("algorithm", alg_cls, field(default_factory=alg_cls))]
    for ps in settings:
        if ps.section in CORE_SECTIONS:
            raise ConfigError(
                f"plugin {ps.plugin!r} declares config section {ps.section!r}, which is a core section"
            )
        if not dataclasses.is_dataclass(ps.schema):
            raise ConfigError(f"plugin {ps.plugin!r}: settings schema for {ps.section!r} must be a dataclass")
        extra.append((ps.section, ps.schema, field(default_factory=ps.schema)))
    return dataclasses.make_dataclass("RunConfigWithPlugins", extra, bases=(RunConfig,))


class _Problems:
    """The config's problems, collected so that one run of ``rlcore check`` names them all."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def add(self, err: ConfigError) -> None:
        if not any(str(e) == str(err) for e in self.found):
            self.found.append(err)

    def attempt(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; a :class:`ConfigError` it raises is collected. Once a problem is known, a
        later check may trip over that bad value in another way: what it raises then is not news."""
        try:
            return fn(*args)
        except ConfigErrors as errs:
            for e in errs.problems:
                self.add(e)
        except ConfigError as err:
            self.add(err)
        except Exception:
            if not self.found:
                raise
        return None

    def raise_if_any(self) -> None:
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise ConfigErrors(self.found)


def validate(raw: DictConfig, settings: Sequence[Any] = (), *, known_plugin_sections: dict[str, str] | None = None,
             algorithms: dict[str, Any] | None = None, environments: dict[str, Any] | None = None,
             launchers: dict[str, Any] | None = None) -> DictConfig:
    """Merge ``raw`` into the structured schema. Errors name the full key; every problem of the
    document is reported at once (:class:`~rlcore.errors.ConfigErrors` when there are several),
    unknown keys with the closest known one. ``algorithms`` and ``environments``: the registered
    algorithm and environment specs by name (default: core's built-ins); ``launchers``: the
    registered launcher specs, whose capabilities become ``cluster.launcher_capabilities`` (default
    none: core's ``local`` launcher declares none)."""
    problems = _Problems()
    known_algorithms = algorithms if algorithms is not None else builtin_algorithms()
    algo = problems.attempt(selected_algorithm, raw, known_algorithms)
    schema = schema_with_plugins(settings, algo or known_algorithms.get("grpo") or next(iter(known_algorithms.values())))
    active_sections = {ps.section for ps in settings}
    top_level = CORE_SECTIONS + tuple(sorted(active_sections))
    raw = raw.copy()
    for key in [str(k) for k in raw.keys()]:
        if key in CORE_SECTIONS or key in active_sections:
            continue
        owner = (known_plugin_sections or {}).get(key)
        if owner:
            problems.add(ConfigError(f"config section {key!r} belongs to plugin {owner!r}, which is not active: add "
                                     f"{owner!r} to plugins:", key=key))
        else:
            problems.add(ConfigError(f"unknown config key {key!r}. Top-level keys: {', '.join(top_level)}"
                                     f"{_did_you_mean(key, top_level)}", key=key))
        del raw[key]
    if algo is None and "algorithm" in raw:  # the algorithm's own keys cannot be checked without it
        raw.algorithm = {k: v for k, v in raw.algorithm.items()
                         if k in {f.name for f in dataclasses.fields(AlgorithmConfig)}}
    engine = raw.get("engine")
    if isinstance(engine, DictConfig) and isinstance(engine.get("model"), str):  # engine.model=DIR: the model's path
        engine.model = {"path": engine.model}
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, raw)
    except (oc_errors.ConfigKeyError, oc_errors.ValidationError, oc_errors.ConfigTypeError, TypeError,
            ValueError) as exc:
        merged = _merge_each_leaf(base, raw, problems, exc)
    OmegaConf.set_readonly(merged, False)
    problems.attempt(_check_values, merged, problems)
    # derived, before the plugins' checks read it; a launcher no active plugin provides declares
    # nothing here (stack.resolve names its plugin)
    launcher = (launchers or {}).get(str(merged.cluster.backend))
    merged.cluster.launcher_capabilities = sorted(launcher.capabilities) if launcher is not None else []
    if algo is not None:
        problems.attempt(_resolve_algorithm, merged, algo,
                         environments if environments is not None else builtin_environments())
    for ps in settings:
        if ps.validate is not None:
            if _takes_two_arguments(ps.validate):
                problems.attempt(ps.validate, merged[ps.section], merged)
            else:
                problems.attempt(ps.validate, merged[ps.section])
    problems.raise_if_any()
    return merged  # type: ignore[return-value]


def _did_you_mean(name: str, candidates: Sequence[str]) -> str:
    close = closest_name(name, candidates)
    return f"; did you mean {close!r}?" if close else ""


def _merge_error(base: DictConfig, raw: Any, exc: Exception) -> ConfigError:
    """The :class:`ConfigError` for omegaconf's merge error ``exc`` (naming the key)."""
    if isinstance(exc, oc_errors.ConfigKeyError):
        key = getattr(exc, "full_key", None) or "?"
        parent, _, leaf = key.rpartition(".")
        known = _known_keys(base, parent)
        return ConfigError(f"unknown config key {key!r}" + (f"; {parent} has: {', '.join(known)}" if known else "")
                           + _did_you_mean(leaf, known), key=key)
    if isinstance(exc, (oc_errors.ValidationError, oc_errors.ConfigTypeError)):
        key = getattr(exc, "full_key", None) or _container_mismatch(base, raw) or "?"
        return ConfigError(f"bad value for config key {key!r}: {str(exc).splitlines()[0]}", key=key)
    key = _container_mismatch(base, raw) or "?"  # omegaconf: a mapping where the schema has a list, ...
    return ConfigError(f"bad value for config key {key!r}: {exc}", key=key)


def _merge_each_leaf(base: DictConfig, raw: DictConfig, problems: _Problems, first: Exception) -> DictConfig:
    """The whole merge failed: merge each leaf of ``raw`` on its own to name every key that does
    not fit (runs only for a document with errors), and return the merge of the leaves that fit."""
    good: list[tuple[str, Any]] = []
    for key, value in _flat(OmegaConf.to_container(raw, resolve=False)):
        one = OmegaConf.create()
        OmegaConf.update(one, key, value, force_add=True)
        try:
            OmegaConf.merge(base, one)
        except (oc_errors.ConfigKeyError, oc_errors.ValidationError, oc_errors.ConfigTypeError, TypeError,
                ValueError) as exc:
            problems.add(_merge_error(base, one, exc))
            continue
        good.append((key, value))
    if not problems.found:  # the leaves fit one by one but not together: say what omegaconf said
        problems.add(_merge_error(base, raw, first))
    ok = OmegaConf.create()
    for key, value in good:
        OmegaConf.update(ok, key, value, force_add=True)
    try:
        return OmegaConf.merge(base, ok)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - what is wrong is already collected
        problems.raise_if_any()
        raise


def _takes_two_arguments(fn: Any) -> bool:
    """``validate(section)`` or ``validate(section, config)`` (the whole resolved config, for
    checks that depend on other sections, e.g. ``engine.device``)."""
    import inspect

    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _container_mismatch(base: Any, raw: Any, prefix: str = "") -> str | None:
    """The first key where ``raw`` has a mapping/list/scalar and the schema another kind."""
    for k in raw.keys():
        if k not in base:
            continue
        b, r = base._get_node(k), raw._get_node(k)
        kinds = [isinstance(x, DictConfig) for x in (b, r)], [isinstance(x, ListConfig) for x in (b, r)]
        if kinds[0][0] != kinds[0][1] or kinds[1][0] != kinds[1][1]:
            return f"{prefix}{k}"
        if isinstance(b, DictConfig):
            found = _container_mismatch(b, r, f"{prefix}{k}.")
            if found:
                return found
    return None


def _known_keys(base: DictConfig, parent: str) -> list[str]:
    node = OmegaConf.select(base, parent) if parent else base
    if isinstance(node, DictConfig):
        return [str(k) for k in node.keys()]
    return []


_CHOICES = {
    "rollout.release_kv_cache": ("auto", "always", "never"),
    "rollout.local_update": LOCAL_UPDATE_MODES,
    "algorithm.loss_agg": (*LOSS_AGGREGATIONS, "auto"),
    "algorithm.kl_estimator": KL_ESTIMATORS,
    "algorithm.kl_in": ("loss", "reward"),
    "algorithm.old_logprobs": ("auto", "rollout", "recompute", "current"),
    "algorithm.mismatch.level": ("token", "sequence", "geometric"),
    "training.on_nonfinite": ("stop", "skip"),
    "output.export_hf": ("checkpoints", "final", "never"),
    "engine.attention": ATTENTION_CHOICES,
    "data.overlong": OVERLONG_CHOICES,
    "lora.push": LORA_PUSH_MODES,
}


def _check_values(cfg: DictConfig, problems: _Problems | None = None) -> None:
    """Every value check of core's sections; with ``problems``, each check's refusal is collected
    and the others still run (without, the first refusal is raised)."""
    own = problems is None  # called alone: raise what it finds
    problems = problems if problems is not None else _Problems()
    for key, choices in _CHOICES.items():
        val = OmegaConf.select(cfg, key)
        if val not in choices:
            problems.add(ConfigError(f"bad value for config key {key!r}: {val!r}; choose one of: {', '.join(choices)}",
                                     key=key))
    _check_ranges(cfg, problems)
    for key in ("data.task", "data.reward"):
        val = OmegaConf.select(cfg, key)
        if ":" not in val:
            problems.add(ConfigError(f"bad value for config key {key!r}: {val!r} must be 'module:function'", key=key))
    for check in (check_local_rollout, check_model, check_cluster, check_loop, check_environment,
                  resolve_seed_per_prompt, check_data_files, check_tracking, check_validation, check_lora):
        problems.attempt(check, cfg)
    if own:
        problems.raise_if_any()


#: numeric keys of core's sections and the range each must lie in (an algorithm's own keys, e.g.
#: ``algorithm.clip_low``, are checked by that algorithm's ``validate``): (low, high, low inclusive, high inclusive);
#: every float must also be finite (a NaN passes every comparison and would train on NaN)
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    **{key: (1, math.inf, True, False) for key in (
        "rollout.n", "rollout.max_new_tokens", "training.micro_batch_tokens", "data.prompts_per_step",
        "training.steps")},
    "rollout.temperature": (0.0, math.inf, True, False),
    "rollout.top_p": (0.0, 1.0, False, True),
    "rollout.top_k": (-1, math.inf, True, False),
    "rollout.draft_depths": (0, math.inf, True, False),
    "rollout.seed": (0, 2**32 - 1, True, True),  # per-step seeds derive from it in int64
    "sync.bucket_mb": (2.0**-20, 1 << 30, True, True),  # 1 byte to 1 PiB: bucket byte counts stay int64
    "sync.delta_max_ratio": (0.0, 1.0, False, True),
    "sync.delta_full_every": (0, math.inf, True, False),
    "forward.chunk_tokens": (1, math.inf, True, False),
    "algorithm.kl_coef": (0.0, math.inf, True, False),
    "algorithm.entropy_coef": (0.0, math.inf, True, False),
    "algorithm.updates_per_step": (1, math.inf, True, False),
    "algorithm.norm_tokens": (0, math.inf, True, False),
    "training.lr": (0.0, math.inf, True, False),
    "training.weight_decay": (0.0, math.inf, True, False),
    "training.grad_clip": (0.0, math.inf, True, False),
    "training.seed": (0, 2**32 - 1, True, True),
    "training.max_wall_seconds": (0.0, math.inf, True, False),
    "data.prompt_len": (1, math.inf, True, False),
    "data.reward_timeout_seconds": (0.0, math.inf, True, False),
    "validation.every_steps": (0, math.inf, True, False),
    "validation.n": (1, math.inf, True, False),
    "validation.temperature": (0.0, math.inf, False, False),
    "validation.max_prompts": (0, math.inf, True, False),
    "output.checkpoint_every": (0, math.inf, True, False),
    "output.keep_checkpoints": (1, math.inf, True, False),
    "engine.model.tiny.init_std": (0.0, math.inf, False, False),
    **{f"engine.model.tiny.{k}": (1, math.inf, True, False) for k in (
        "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_experts",
        "topk", "moe_intermediate_size")},
    "engine.model.tiny.mtp_layers": (0, math.inf, True, False),
    "lora.rank": (0, math.inf, True, False),
    "lora.alpha": (0.0, math.inf, False, False),
    "lora.dropout": (0.0, 1.0, True, False),
    "engine.model.tiny.vocab_size": (0, math.inf, True, False),
    "engine.model.tiny.seed": (-(2**63), 2**64 - 1, True, True),  # torch.Generator.manual_seed's domain
}


def _flat(node: Any, prefix: str = "", *, into_lists: bool = False) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a config container (lists are leaves unless ``into_lists``)."""
    if isinstance(node, dict) or (into_lists and isinstance(node, list)):
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            yield from _flat(v, f"{prefix}{k}.", into_lists=into_lists)
    else:
        yield prefix[:-1], node


def _check_ranges(cfg: DictConfig, problems: _Problems | None = None) -> None:
    own = problems is None  # called alone: raise what it finds
    problems = problems if problems is not None else _Problems()
    for key, val in _flat(OmegaConf.to_container(cfg, resolve=True), into_lists=True):
        if isinstance(val, float) and not math.isfinite(val):  # NaN passes every < and >
            problems.add(ConfigError(f"bad value for config key {key!r}: {val!r}; must be a finite number", key=key))
    for key, (lo, hi, lo_in, hi_in) in _RANGES.items():
        val = OmegaConf.select(cfg, key)
        if (val is None or (isinstance(val, float) and not math.isfinite(val)) or (lo < val < hi)
                or (val == lo and lo_in) or (val == hi and hi_in)):
            continue
        if hi == math.inf:
            problems.add(ConfigError(f"bad value for config key {key!r}: {val!r}; must be "
                                     f"{'>=' if lo_in else '>'} {lo:g}", key=key))
        else:
            problems.add(ConfigError(f"bad value for config key {key!r}: {val!r}; must be in "
                                     f"{'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}", key=key))
    betas = list(cfg.training.betas)
    if len(betas) != 2 or not all(isinstance(b, float) and 0.0 <= b < 1.0 for b in betas):
        problems.add(ConfigError(f"bad value for config key 'training.betas': {betas!r}; must be two numbers in "
                                 f"[0, 1)", key="training.betas"))
    if own:
        problems.raise_if_any()


#: keys that do not change what a run computes, so resuming with another value is fine: where the
#: output goes and how it is shown, how long the run goes on, what a non-finite step does (resuming
#: a stopped run with ``skip`` is the point), how weights travel (not what they are), where the
#: engine runs, and how a step is split into micro-batches (the loss aggregation is exact over
#: micro-batches).
FINGERPRINT_EXCLUDED = (
    "output.",
    "training.steps",
    "training.max_wall_seconds",
    "training.on_nonfinite",
    "training.micro_batch_tokens",
    "data.reward_timeout_seconds",  # raising it to resume a run the limit stopped is the point
    "forward.chunk_tokens",
    "sync.bucket_mb",
    "sync.verify",
    "sync.delta",  # how the weights travel (only what changed), not what they are: every push is verified
    "sync.delta_max_ratio",
    "sync.delta_full_every",
    "engine.device",
    "engine.attention",  # packed or padded rows: the same attention, summed in another order
    "cluster.",  # where ranks run; data-parallel ranks hold the same weights, so any size resumes
    "tracking.",  # where the metrics are shown, besides metrics.jsonl
    "validation.",  # measures the weights; training is the same with or without it (rlcore.validation)
)


def training_fingerprint(cfg: DictConfig, settings: Sequence[Any] = ()) -> dict[str, Any]:
    """The flattened config (``{"algorithm.kl_coef": 0.0, ...}``) minus :data:`FINGERPRINT_EXCLUDED`
    and the plugin sections (``settings``: the active plugins' :class:`~rlcore.types.PluginSettings`)
    that do not affect training: what a checkpoint stores so that ``--resume`` can name every key
    that differs."""
    excluded = (*FINGERPRINT_EXCLUDED, *(f"{ps.section}." for ps in settings if not ps.affects_training))
    return {key: val for key, val in _flat(OmegaConf.to_container(cfg, resolve=True))
            if not any(key == e or (e.endswith(".") and key.startswith(e)) for e in excluded)}


def fingerprint_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for every key whose value differs (or exists on one side only)."""
    missing = object()
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, missing), current.get(key, missing)
        if a != b:
            out.append(f"{key}: {'(absent)' if a is missing else repr(a)} -> {'(absent)' if b is missing else repr(b)}")
    return out


def _resolve_algorithm(cfg: DictConfig, spec: Any, environments: dict[str, Any]) -> None:
    """Check core's algorithm values, resolve the ``auto``\\ s, then run the algorithm's own
    ``validate``."""
    a = cfg.algorithm
    a.name = spec.name  # core's values are in _RANGES, checked before
    corrects = check_modifiers(cfg)  # KL control, DAPO; mismatch TIS, masks or rejection (rlcore.algorithm_settings)
    if a.old_logprobs == "auto":
        a.old_logprobs = "recompute" if corrects else "rollout"
    elif corrects and a.old_logprobs == "rollout":
        raise ConfigError(
            "bad value for config key 'algorithm.old_logprobs': 'rollout' cannot be combined with algorithm.mismatch "
            "correction (its weights are trainer/rollout ratios; the PPO ratio must then be against the trainer's "
            "recomputed log-probs): use 'recompute' or 'auto'", key="algorithm.old_logprobs")
    if a.old_logprobs == "current":
        _check_current_proximal(cfg, spec)
    if a.loss_agg == "auto":
        a.loss_agg = spec.loss_agg or "token-mean"
    if a.loss_agg == "seq-mean-token-sum-norm" and not a.norm_tokens:
        a.norm_tokens = int(cfg.rollout.max_new_tokens)
    env = cfg.get("environment")
    env_spec = environments.get(str(env.name)) if env is not None else None
    # an environment no active plugin provides is named by stack.resolve; here only what is known
    if getattr(spec, "single_turn", False) and getattr(env_spec, "multi_turn", False):
        raise ConfigError(f"environment.name={env.name!r} runs multi-turn conversations, but algorithm.name="
                          f"{spec.name} is single-turn only ({spec.description}: one completion per prompt): use "
                          f"grpo or rloo (their group baselines cover whole conversations), or "
                          f"environment.name=single_turn", key="environment.name")
    if spec.validate is not None:
        spec.validate(a)


def _check_current_proximal(cfg: DictConfig, spec: Any) -> None:
    """``algorithm.old_logprobs: current`` is exact only where nothing needs the trainer's
    log-probs before the train pass and the policy takes one optimizer step per batch."""
    a, mm = cfg.algorithm, cfg.algorithm.mismatch
    needs = "; use algorithm.old_logprobs: recompute"
    if int(a.updates_per_step) != 1:
        raise ConfigError(f"algorithm.old_logprobs 'current' needs algorithm.updates_per_step 1 (from the second "
                          f"update on the proximal policy is no longer the current one), got {a.updates_per_step}"
                          + needs, key="algorithm.updates_per_step")
    level_ok = mm.level == "token" and not mm.reject
    if (float(mm.tis_cap) > 0 or float(mm.mask_low) > 0 or float(mm.mask_high) > 0 or mm.reject) and not level_ok:
        key = "algorithm.mismatch.reject" if mm.reject else "algorithm.mismatch.level"
        raise ConfigError(f"algorithm.old_logprobs 'current' computes the mismatch weights per token inside the loss; "
                          f"{key} ({mm.reject or mm.level!r}) needs every token of a sequence first" + needs, key=key)
    if a.kl_in == "reward" and float(a.kl_coef) > 0:
        raise ConfigError("algorithm.old_logprobs 'current' has no trainer log-probs before the train pass, which "
                          "algorithm.kl_in 'reward' shapes the rewards with" + needs, key="algorithm.kl_in")
    if Cap.SUM_PI_SQUARED in tuple(getattr(spec, "head_needs", ())):
        raise ConfigError(f"algorithm.old_logprobs 'current' skips the no-grad pass that gives algorithm "
                          f"{spec.name!r} the sum of squared probabilities it needs" + needs,
                          key="algorithm.old_logprobs")
    loop = cfg.get("loop")
    if loop is not None and loop.get("mode", "sync") != "sync" and loop.get("stale") == "rescore":
        raise ConfigError("algorithm.old_logprobs 'current' has no trainer log-probs to re-score stale samples "
                          "with (loop.stale rescore): use loop.stale drop" + needs, key="loop.stale")
    critic = a.get("critic")
    if critic is not None and int(critic.get("warmup_steps", 0) or 0) > 0:
        raise ConfigError("algorithm.old_logprobs 'current' needs a train pass every step; "
                          "algorithm.critic.warmup_steps freezes the policy for the first steps" + needs,
                          key="algorithm.critic.warmup_steps")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
