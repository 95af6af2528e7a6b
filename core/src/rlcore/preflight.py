"""What ``rlcore train`` would hit, found before anything starts: ``rlcore check`` runs
:func:`preflight`, and :class:`rlcore.trainer.Trainer` runs it before it touches the output
directory. Each problem is a :class:`~rlcore.errors.ConfigError` naming the key to change, in one
line (the CLI prints it without a traceback).

Config validation (:mod:`rlcore.config`) checks each value alone; this module checks what needs
more than the document: the machine (``engine.device``, memory), the model (``engine.model.path``
on disk, the tiny model's size and vocabulary; its shapes are :mod:`rlcore.model_settings`'), the
task and reward modules, and the prompts the task makes measured with the engine's tokenizer
against the model's context. Size limits are absurd-only:
a size is refused when a lower bound of what it needs exceeds all the memory this machine has
(RAM, swap and every GPU together), never by a fixed cap on one field, so any configuration that
could run somewhere on this machine passes. Memory is not checked where the run's ranks are on
other machines (the launcher says so: ``ray.address``) or on a device whose memory core cannot read.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.config import DataConfig, RolloutConfig, TinyModelConfig
from rlcore.errors import ConfigError
from rlcore.errors import one_line as _one_line
from rlcore.model_settings import DTYPE_BYTES
from rlcore.types import Cap

__all__ = ["MAX_LR", "MIN_TEMPERATURE", "TINY_MAX_POSITIONS", "load_reward", "preflight", "tiny_parameters"]

#: below this ``rollout.temperature`` a run is refused. The head and the local sampler divide fp32
#: logits by it: a logit of magnitude 10 carries a rounding error of about 1e-6 (fp32's epsilon
#: 1.2e-7 x 10), which 1/T turns into a nat or more of log-prob noise between the rollout and the
#: trainer's recomputation below 1e-6, so the importance ratios measure rounding, not the policy.
#: Sampling is greedy in effect well before that (rlcore-vllm sends T < 1e-5 to vLLM as 0; a run at
#: 1e-30 trains with every sample of a prompt the same, advantages and gradients 0), and it breaks
#: outright further down (1e-38: NaN gradients; 1e-40: inf probabilities fail the sampler). 1e-6 is
#: the smallest temperature that is still greedy decoding and not rounding noise (examples/
#: vllm_tiny_mtp.yaml decodes greedily at it); RL samples at 0.6 to 1.2.
MIN_TEMPERATURE = 1e-6
#: at or above this ``training.lr`` (or ``algorithm.critic.lr``) a run is refused. The engines
#: train with AdamW, whose first update moves every weight with a gradient by exactly ``lr``
#: (bias-corrected m/sqrt(v) is the gradient's sign), whatever the gradient's size: at lr >= 1 one
#: step replaces every weight (initialised at std 0.02 to 0.08, pretrained mostly |w| < 1) by
#: noise of that amplitude. Measured on examples/tiny.yaml: lr 1 and 100 collapse the entropy to 0
#: within 4 steps, 1e10 overflows float32 activations (inf in the sampler, a traceback). LLM RL
#: uses 1e-7 to 1e-5, pretraining at most about 1e-2; the tiny example 1e-3.
MAX_LR = 1.0
#: the largest float32: a loss or reward coefficient above it is inf in the trainer's float32 math
FLOAT32_MAX = 3.4028234663852886e38
#: a lower bound of the bytes a step holds per token however it is split: the token id (int64),
#: its behaviour log-prob and advantage (fp32 each); activations and KV cache come on top
BATCH_BYTES_PER_TOKEN = 16
#: prompts measured against the model's context: the first steps' prompts, made exactly as the
#: trainer makes them (about 0.1 s for 1024 prompts of 50 words); prompts of later steps are not
PROMPTS_CHECKED = 1024
#: the tiny model's context (rlcore.engines.tiny.tiny_config)
TINY_MAX_POSITIONS = 512


@dataclass
class ModelFacts:
    """What preflight learned about the model without building it."""

    source: str  #: ``tiny qwen2`` or the directory
    max_positions: int | None = None
    parameters: int | None = None  #: a lower bound (the weight matrices), tiny model only
    weight_bytes: int | None = None
    tokenizer: Any = None


@dataclass
class PreflightReport:
    """What was checked, for ``rlcore check`` to print."""

    model: ModelFacts | None = None
    longest_prompt: int | None = None
    prompts_checked: int = 0
    step_tokens: int | None = None
    memory_bytes: int | None = None
    skipped: list[str] = field(default_factory=list)
    #: the prompts of ``data.train_files`` / ``data.val_files``: what was read, rendered and filtered
    data: list[str] = field(default_factory=list)
    #: the task (from files: rlcore.datasets.DatasetTask), for the trainer to reuse what was read
    task: Any = None
    #: the environment's spec says it answers turns (``EnvironmentSpec.multi_turn``)
    multi_turn: bool = False

    def lines(self, cfg: Any) -> list[str]:
        out = []
        m = self.model
        if m is not None:
            size = f", {_count(m.parameters)} parameters" if m.parameters else ""
            size += f", weights {_bytes(m.weight_bytes)}" if m.weight_bytes else ""
            out.append(f"model {m.source}{size}")
            if m.parameters:
                copies, held = model_copies(cfg)
                dtype = str(cfg.engine.model.dtype)
                out.append(f"training holds at least {_bytes(m.parameters * DTYPE_BYTES[dtype] * copies)} of "
                           f"{dtype} model state ({held})")
        if self.longest_prompt is not None and m is not None and m.max_positions:
            total, how = longest_conversation(cfg, self.longest_prompt, self.multi_turn)
            adds_up = f"{how} = {total}" if self.multi_turn else how
            out.append(f"{adds_up} <= {m.max_positions} positions ({self.prompts_checked} prompts measured)")
        if self.step_tokens is not None and self.memory_bytes is not None:
            out.append(f"a step holds about {_count(self.step_tokens)} tokens; this machine has "
                       f"{_bytes(self.memory_bytes)} (RAM, swap and GPUs)")
        out.extend(self.data)
        out.extend(f"not checked: {s}" for s in self.skipped)
        return out


def preflight(stack: Any) -> PreflightReport:
    """Check ``stack`` (a resolved :class:`rlcore.stack.Stack`) against this machine, its model,
    task and reward; raise :class:`ConfigError` naming the key of the first problem."""
    cfg = stack.config
    report = PreflightReport(multi_turn=bool(getattr(stack.environment, "multi_turn", False)))
    check_optimizer(cfg)
    check_temperature(cfg)
    check_device(stack, report)
    task = report.task = load_task(cfg)
    load_reward(cfg)
    memory = reachable_memory(stack, report)
    report.memory_bytes = memory
    check_tools(cfg, memory)
    # the step's size first: an absurd data.prompts_per_step must not be generated to be measured
    check_step_size(cfg, memory, prompt_tokens=1, measured=False)
    if Cap.ENGINE_MODEL not in stack.engine.capabilities:  # its model comes from its own settings
        report.skipped.append(f"the model of engine {stack.engine.name!r} (it does not declare {Cap.ENGINE_MODEL!r}: "
                              f"its model is not engine.model)")
        return report
    facts = model_facts(cfg, task, memory)
    report.model = facts
    if getattr(task, "source", None) is not None:  # data.train_files: every row rendered and measured
        longest, measured = measure_dataset(cfg, task, facts, report)
    else:
        longest, measured = measure_prompts(cfg, task, facts, multi_turn=report.multi_turn)
    report.longest_prompt, report.prompts_checked = longest, measured
    report.step_tokens = check_step_size(cfg, memory, prompt_tokens=max(longest, 1))
    return report


# ----------------------------------------------------------------------------- sampling --

def check_temperature(cfg: Any) -> None:
    t = float(cfg.rollout.temperature)
    if t <= 0:
        raise ConfigError(f"rollout.temperature={t:g}: RL training samples, so it must be > 0 (at least "
                          f"{MIN_TEMPERATURE:g})", key="rollout.temperature")
    if t < MIN_TEMPERATURE:
        raise ConfigError(f"rollout.temperature={t:g} is below {MIN_TEMPERATURE:g}: fp32 logits divided by it give "
                          f"log-probs decided by rounding, not the model (far below, NaN gradients and a failing "
                          f"sampler); use {MIN_TEMPERATURE:g} to decode greedily, 0.6 to 1.2 to train by RL",
                          key="rollout.temperature")


# ---------------------------------------------------------------------------- optimizer --

def check_optimizer(cfg: Any) -> None:
    """Optimizer and loss settings that make training diverge or non-finite whatever the data:
    a learning rate of :data:`MAX_LR` or more, decoupled weight decay that multiplies every weight
    by ``1 - lr * weight_decay`` <= 0 each step (0 wipes the model, below 0 flips its signs and, below
    -1, grows it geometrically to inf), and any ``algorithm.`` float (core's and the algorithm's
    own keys) or ``environment.tool_call_reward`` beyond float32's range (inf once in a tensor)."""
    from omegaconf import OmegaConf

    from rlcore.config import _flat

    t = cfg.training
    rates = {"training.lr": float(t.lr)}
    critic_lr = _select(cfg, "algorithm.critic.lr")
    if critic_lr:
        rates["algorithm.critic.lr"] = float(critic_lr)
    for key, lr in rates.items():
        if lr >= MAX_LR:
            raise ConfigError(f"{key}={lr:g}: AdamW's first step moves every weight by lr whatever the gradient, so "
                              f"at {MAX_LR:g} or more one step turns the model into noise (and from about 1e9 "
                              f"float32 activations overflow); use below {MAX_LR:g} (LLM RL: 1e-7 to 1e-5)", key=key)
        decay = lr * float(t.weight_decay)
        if decay >= 1:
            raise ConfigError(f"training.weight_decay={float(t.weight_decay):g}: with {key}={lr:g} decoupled decay "
                              f"multiplies every weight by 1 - lr x weight_decay = {1 - decay:g} each step (0 wipes "
                              f"the model; below 0 flips it, and grows it to inf below -1); keep lr x weight_decay "
                              f"below 1 (usually weight_decay 0 to 0.1)", key="training.weight_decay")
    floats = [(f"algorithm.{k}", v) for k, v in _flat(OmegaConf.to_container(cfg.algorithm, resolve=True))]
    floats.append(("environment.tool_call_reward", _select(cfg, "environment.tool_call_reward")))
    for key, val in floats:
        if isinstance(val, float) and math.isfinite(val) and abs(val) > FLOAT32_MAX:
            raise ConfigError(f"{key}={val:g} is beyond float32's range ({FLOAT32_MAX:.4g}): the trainer's float32 "
                              f"losses and rewards would hold inf", key=key)


# -------------------------------------------------------------------------------- tools --

def check_tools(cfg: Any, memory: int | None) -> None:
    """The limits of every tool call: ``environment.tool_timeout_seconds`` no more than
    :data:`~rlcore.environments.tools.MAX_TOOL_SECONDS`, ``environment.tool_output_chars`` within
    this machine's memory. (The tools ``environment.tools`` names are selected when the config is
    resolved; a plugin's tool checks its own limits in its section.)"""
    env = getattr(cfg, "environment", None)
    if env is None:
        return
    from rlcore.environments.tools import MAX_TOOL_SECONDS

    if float(env.tool_timeout_seconds) > MAX_TOOL_SECONDS:
        raise ConfigError(f"environment.tool_timeout_seconds={float(env.tool_timeout_seconds):g}: a tool limit of more "
                          f"than {MAX_TOOL_SECONDS:g} s (a day) does not limit anything (one call holds the whole step "
                          f"that long); use seconds to minutes", key="environment.tool_timeout_seconds")
    size = int(env.tool_output_chars) * 4
    if memory is not None and size > memory:
        raise ConfigError(f"environment.tool_output_chars={env.tool_output_chars}: {_bytes(size)}, more than this "
                          f"machine's {_bytes(memory)} (RAM, swap and GPUs)", key="environment.tool_output_chars")


# ------------------------------------------------------------------------------- device --

def _remote(stack: Any) -> str | None:
    """Where the run's ranks are when they are on other machines (a Ray cluster joined by address),
    as the selected launcher says; None when they run here."""
    spec = stack.launcher
    if spec is None or not spec.ranks_are_remote(stack.config):
        return None
    return f"other machines (launcher {spec.name!r})"


def check_device(stack: Any, report: PreflightReport) -> None:
    """``engine.device`` names a device this machine (and this torch) has."""
    cfg = stack.config
    text = str(cfg.engine.device).strip().lower()
    kind, _, index = text.partition(":")
    if index and not (index.isdigit()):
        raise ConfigError(f"engine.device={cfg.engine.device}: the index after ':' must be a number (cuda:1)",
                          key="engine.device")
    spec = stack.platform
    if spec is None or spec.device_type == "cpu":
        return
    if (where := _remote(stack)) is not None:
        report.skipped.append(f"engine.device={text} (the ranks run on {where})")
        return
    if spec.device_type == "cuda":
        import torch

        if torch.version.cuda is None:
            raise ConfigError(f"engine.device={text} but this torch ({torch.__version__}) has no CUDA; use "
                              f"engine.device=cpu", key="engine.device")
        if not torch.cuda.is_available():
            raise ConfigError(f"engine.device={text} but torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
                              f"no GPU here (torch.cuda.is_available() is False); use engine.device=cpu",
                              key="engine.device")
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise ConfigError(f"engine.device={text} but this machine has {count} CUDA device(s) (cuda:0 to "
                              f"cuda:{count - 1})", key="engine.device")
        return
    if not spec.available():
        raise ConfigError(f"engine.device={text}: platform {spec.name!r} ({spec.source()}) is not available on "
                          f"this machine; use engine.device=cpu", key="engine.device")


# ------------------------------------------------------------------------ task, reward --

def _import(path: str, key: str) -> Callable[..., Any]:
    from rlcore.tasks import load_callable

    try:
        return load_callable(path, key)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the module raised while being imported
        raise ConfigError(f"{key}: importing {path!r} raised {type(exc).__name__}: {_one_line(exc)}",
                          key=key) from exc


def load_task(cfg: Any) -> Any:
    """``data.task`` imported and called, as the trainer does; with ``data.train_files`` the
    files read and their keys checked (:func:`rlcore.datasets.build_task`)."""
    from rlcore.datasets import build_task, data_files

    if data_files(cfg):
        return build_task(cfg)
    fn = _import(str(cfg.data.task), "data.task")
    try:
        task = fn(cfg.data)
    except Exception as exc:  # noqa: BLE001 - the user's task function
        raise ConfigError(f"data.task: {cfg.data.task}(data) raised {type(exc).__name__}: {_one_line(exc)}",
                          key="data.task") from exc
    if not isinstance(getattr(task, "vocab", None), (list, tuple)) or not callable(getattr(task, "make_prompts", None)):
        raise ConfigError(f"data.task: {cfg.data.task}(data) returned {type(task).__name__}, not a rlcore.tasks.Task "
                          f"(vocab, make_prompts; docs/tasks.md)", key="data.task")
    return task


def load_reward(cfg: Any) -> Callable[..., Any]:
    fn = _import(str(cfg.data.reward), "data.reward")
    try:
        inspect.signature(fn).bind(object())
    except TypeError as exc:
        raise ConfigError(f"data.reward: {cfg.data.reward} cannot be called with one RewardInput: {exc}",
                          key="data.reward") from exc
    except ValueError:  # no signature to read (a builtin): the trainer finds out
        pass
    from rlcore.tasks import resolve_reward

    return resolve_reward(fn, cfg.data)  # a reward factory built, as the trainer does


# -------------------------------------------------------------------------------- model --

def model_facts(cfg: Any, task: Any, memory: int | None) -> ModelFacts:
    model = cfg.engine.model
    dtype = str(model.dtype)  # a known one: rlcore.model_settings checked it, and the tiny model's shapes
    copies, held = model_copies(cfg)
    if model.path:
        facts = _directory_facts(Path(str(model.path)))
        if memory is not None and facts.parameters:
            need = facts.parameters * DTYPE_BYTES[dtype] * copies
            if need > memory:
                raise ConfigError(f"engine.model.path={model.path}: its {_count(facts.parameters)} parameters in "
                                  f"{dtype} need at least {_bytes(need)} to train ({copies} copies: {held}), more "
                                  f"than this machine's {_bytes(memory)} (RAM, swap and GPUs)", key="engine.model.path")
        return facts
    facts = _tiny_facts(cfg, task, DTYPE_BYTES[dtype])
    if memory is not None and facts.weight_bytes * copies > memory:
        alone = facts.weight_bytes > memory
        times = 1 if alone else copies
        key = _culprit(lambda t: tiny_parameters(t, _tiny_vocab(t, facts.tokenizer)) * DTYPE_BYTES[dtype] * times,
                       model.tiny, _TINY_DEFAULTS, prefix="engine.model.tiny.")
        need = (f"{_bytes(facts.weight_bytes)} of {dtype} weights alone" if alone else
                f"{_bytes(facts.weight_bytes * copies)} to train ({copies} copies of its {_bytes(facts.weight_bytes)} "
                f"of {dtype} weights: {held})")
        raise ConfigError(f"{key}={model.tiny[key.rsplit('.', 1)[1]]}: the tiny model has at least "
                          f"{_count(facts.parameters)} parameters, {need}, more than this machine's "
                          f"{_bytes(memory)} (RAM, swap and GPUs)", key=key)
    return facts


def model_copies(cfg: Any) -> tuple[int, str]:
    """How many model-sized tensors of ``engine.model.dtype`` a run holds at least, and which:
    the engines train with torch's AdamW on the model's own parameters (no separate master
    copy), so the policy is its weights, their gradients and AdamW's two moments (``exp_avg``,
    ``exp_avg_sq``, each shaped and typed as its parameter); a KL reference (``algorithm.kl_coef``
    > 0) is a frozen copy, PPO's critic another trained model, the ``local`` rollout backend its
    own copy (and one more staged for each push with ``rollout.local_update=staged``).
    Activations, KV cache and the step's batch come on top."""
    parts = [(1, "weights"), (1, "gradients"), (2, "AdamW's exp_avg and exp_avg_sq")]
    if float(cfg.algorithm.kl_coef) > 0:
        parts.append((1, "the KL reference"))
    if "critic" in cfg.algorithm:
        parts.append((4, "PPO's critic with its gradients and moments"))
    if str(cfg.rollout.backend) == "local":
        parts.append((1, "the local rollout's copy"))
        if str(cfg.rollout.local_update) == "staged":
            parts.append((1, "its staged push"))
    return sum(n for n, _ in parts), ", ".join(what for _, what in parts)


def _directory_facts(path: Path) -> ModelFacts:
    key = "engine.model.path"
    if not path.exists():
        raise ConfigError(f"{key}={path}: no such directory", key=key)
    if not path.is_dir():
        raise ConfigError(f"{key}={path}: not a directory (a Hugging Face model directory holds config.json, "
                          f"weights and tokenizer)", key=key)
    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key}={path}: no config.json there (not a Hugging Face model directory)", key=key) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path}: cannot read config.json: {_one_line(exc)}", key=key) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}={path}: config.json is not a JSON object", key=key)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    heads, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        raise ConfigError(f"{key}={path}: config.json has num_attention_heads={heads}, not a multiple of "
                          f"num_key_value_heads={kv}", key=key)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises for a directory it cannot read
        raise ConfigError(f"{key}={path}: cannot load its tokenizer: {type(exc).__name__}: {_one_line(exc)}",
                          key=key) from exc
    weights, parameters = check_weight_files(path)
    positions = text.get("max_position_embeddings")
    return ModelFacts(source=f"{path} ({raw.get('model_type', '?')})",
                      max_positions=positions if isinstance(positions, int) and positions > 0 else None,
                      parameters=parameters, weight_bytes=weights or None, tokenizer=tokenizer)


#: bytes per element of each safetensors dtype (the format's names)
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                           "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
                           "F8_E8M0": 1}
#: a safetensors header larger than this is not one (the format caps it at 100 MB)
SAFETENSORS_MAX_HEADER = 100_000_000


def check_weight_files(path: Path) -> tuple[int, int | None]:
    """The bytes of the directory's weight files and the parameters they hold, checked as
    transformers would load them, without reading the tensors: every ``*.safetensors`` file's
    header parsed and its tensors' offsets checked against their shapes and the file's size (a
    truncated or damaged file), every shard a ``*.safetensors.index.json`` names present; with no
    safetensors, ``*.bin`` pickles opened as torch's ``weights_only`` loader opens them
    (memory-mapped: what is not plain tensors is refused without running it). No weight file at
    all is refused too (transformers would fail, or initialise the model randomly)."""
    key = "engine.model.path"
    tensors = sorted(path.glob("*.safetensors"))
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{key}={path}: {index.name} is not a readable safetensors index: {_one_line(exc)}",
                              key=key) from exc
        missing = sorted(str(s) for s in shards if not (path / str(s)).is_file())
        if missing:
            raise ConfigError(f"{key}={path}: {index.name} names {len(missing)} shard(s) that are not there: "
                              f"{', '.join(missing[:3])}", key=key)
    if tensors:
        parameters = sum(_safetensors_elements(f, key) for f in tensors)
        return sum(f.stat().st_size for f in tensors), parameters
    pickles = sorted(path.glob("*.bin"))
    if not pickles:
        raise ConfigError(f"{key}={path}: no weights there (no *.safetensors or *.bin file next to config.json)",
                          key=key)
    for f in pickles:
        _check_pickle(f, key)
    return sum(f.stat().st_size for f in pickles), None


def _safetensors_elements(file: Path, key: str) -> int:
    """The elements of the tensors in ``file``, from its header; a file transformers could not
    load (short, a header that is not one, tensors past its end) is refused naming it."""
    size = file.stat().st_size
    where = f"{key}={file.parent}: {file.name} ({size} bytes)"
    try:
        with file.open("rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(size - 8, SAFETENSORS_MAX_HEADER):
                raise ConfigError(f"{where} is not a complete safetensors file (its header of {max(length, 0)} bytes "
                                  f"does not fit in it): truncated or not safetensors", key=key)
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {_one_line(exc)}", key=key) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: its safetensors header is not JSON ({_one_line(exc)}): damaged", key=key) from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{where}: its safetensors header is not a JSON object: damaged", key=key)
    elements, end = 0, 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (begin, stop), dtype = [int(d) for d in t["shape"]], t["data_offsets"], str(t["dtype"])
            begin, stop = int(begin), int(stop)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: tensor {name!r} has a malformed header entry: damaged", key=key) from exc
        count = math.prod(shape)
        width = SAFETENSORS_DTYPE_BYTES.get(dtype)
        if begin < 0 or stop < begin or (width is not None and stop - begin != count * width):
            raise ConfigError(f"{where}: tensor {name!r} ({dtype} {shape}) has data offsets {begin}..{stop} that do "
                              f"not fit its shape: damaged", key=key)
        elements += count
        end = max(end, stop)
    if 8 + length + end != size:
        raise ConfigError(f"{where}: its tensors need {8 + length + end} bytes"
                          f"{'; the file is truncated' if size < 8 + length + end else ', the file holds more'} "
                          f"(transformers cannot load it)", key=key)
    return elements


def _check_pickle(file: Path, key: str) -> None:
    """A ``*.bin`` weight file opened as transformers opens it (torch's ``weights_only`` loader),
    memory-mapped so that the tensors are not read; a pickle of anything but tensors is refused
    without being run."""
    import pickle

    import torch

    where = f"{key}={file.parent}: {file.name}"
    try:
        torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        import re

        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f": it calls {found.group(1)}" if found else ""
        raise ConfigError(f"{where} is a pickle of more than tensors{what}, which rlcore does not run (torch's "
                          f"weights_only loader refuses it); convert the weights to safetensors", key=key) from exc
    except RuntimeError as exc:
        if "mmap" in str(exc):  # torch's legacy (pre-1.6) format cannot be mapped: check it without mapping
            try:
                torch.load(file, map_location="meta", weights_only=True)
                return
            except pickle.UnpicklingError as inner:
                raise ConfigError(f"{where} is a pickle of more than tensors, which rlcore does not run; convert the "
                                  f"weights to safetensors", key=key) from inner
            except Exception as inner:  # noqa: BLE001 - a damaged legacy file
                exc = inner  # type: ignore[assignment]
        raise ConfigError(f"{where} cannot be loaded: {type(exc).__name__}: {_one_line(exc, 160)}", key=key) from exc
    except Exception as exc:  # noqa: BLE001 - a truncated zip, not a torch file at all
        raise ConfigError(f"{where} cannot be loaded: {type(exc).__name__}: {_one_line(exc, 160)}", key=key) from exc


_TINY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TinyModelConfig)}


def _tiny_facts(cfg: Any, task: Any, dtype_bytes: int) -> ModelFacts:
    from rlcore.engines.tiny import make_tokenizer

    t, p = cfg.engine.model.tiny, "engine.model.tiny."
    check_vocab(cfg, task)
    try:
        tokenizer = make_tokenizer(task.vocab, chat_template=getattr(task, "chat_template", None))
    except Exception as exc:  # noqa: BLE001 - what the tokenizers library refuses past check_vocab
        raise ConfigError(f"data.task: the tiny model's tokenizer cannot be built from task {task.name!r}'s vocab "
                          f"({cfg.data.task}): {type(exc).__name__}: {_one_line(exc, 200)}", key="data.task") from exc
    if t.vocab_size and t.vocab_size < len(tokenizer):
        raise ConfigError(f"{p}vocab_size={t.vocab_size}: the task's tokenizer has {len(tokenizer)} tokens; use 0 "
                          f"(the tokenizer's size) or at least {len(tokenizer)}", key=f"{p}vocab_size")
    params = tiny_parameters(t, _tiny_vocab(t, tokenizer))
    return ModelFacts(source=f"tiny {t.arch}", max_positions=TINY_MAX_POSITIONS, parameters=params,
                      weight_bytes=params * dtype_bytes, tokenizer=tokenizer)


def check_vocab(cfg: Any, task: Any) -> None:
    """The task's vocabulary as the tiny model's word-level tokenizer needs it: each word a
    non-empty str of UTF-8 encodable characters (no lone surrogates) without whitespace (the
    tokenizer splits text at whitespace, so such a word could never be a token)."""
    for i, word in enumerate(task.vocab):
        what = None
        if not isinstance(word, str):
            what = f"is a {type(word).__name__}, not a str"
        elif not word:
            what = "is empty"
        elif any(ch.isspace() for ch in word):
            what = "holds whitespace (the tokenizer splits text there: it could never be one token)"
        else:
            try:
                word.encode("utf-8")
            except UnicodeEncodeError as exc:
                what = f"holds {word[exc.start]!r} at {exc.start}, which is not encodable text (a lone surrogate)"
        if what is not None:
            raise ConfigError(f"data.task: word {i} of task {getattr(task, 'name', '?')!r}'s vocab ({cfg.data.task}), "
                              f"{word!r:.60}, {what}", key="data.task")


def _tiny_vocab(t: Any, tokenizer: Any) -> int:
    return int(t.vocab_size or len(tokenizer))


def tiny_parameters(t: Any, vocab: int) -> int:
    """A lower bound of the tiny model's parameter count: its weight matrices (norms and biases
    left out), from the same settings :func:`rlcore.engines.tiny.tiny_config` reads."""
    h, q, kv = int(t.hidden_size), int(t.num_heads) * int(t.head_dim), int(t.num_kv_heads) * int(t.head_dim)
    attention = 2 * h * q + 2 * h * kv
    if t.arch == "qwen2":
        mlp = 3 * h * int(t.intermediate_size)
    else:
        mlp = int(t.num_experts) * (3 * h * int(t.moe_intermediate_size) + h)
        if t.arch == "qwen2_moe":
            mlp += 3 * h * int(t.intermediate_size)  # the shared expert
    layers = int(t.num_layers) + (int(t.mtp_layers) if t.arch == "qwen2" else 0)
    embeddings = vocab * h * (1 if t.tie_word_embeddings else 2)
    return layers * (attention + mlp) + embeddings


# -------------------------------------------------------------------------------- sizes --

def reachable_memory(stack: Any, report: PreflightReport) -> int | None:
    """Bytes of memory a run on this machine could use at most: RAM, swap and, for a CUDA device,
    every GPU's memory. None where it cannot be known here (reasons go to ``report.skipped``)."""
    if (where := _remote(stack)) is not None:
        report.skipped.append(f"memory (the ranks run on {where})")
        return None
    kind = getattr(stack.platform, "device_type", "cpu")
    if kind not in ("cpu", "cuda"):
        report.skipped.append(f"memory (core cannot read the memory of device type {kind!r})")
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        report.skipped.append("memory (this system does not report its RAM)")
        return None
    total += _swap_bytes()
    if kind == "cuda":
        import torch

        total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return int(total)


def _swap_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


#: the factors of a step's size, with their defaults (the culprit is the one whose default shrinks it most)
_STEP_KEYS = {"data.prompts_per_step": DataConfig.prompts_per_step, "rollout.n": RolloutConfig.n,
              "rollout.max_new_tokens": RolloutConfig.max_new_tokens}


def check_step_size(cfg: Any, memory: int | None, *, prompt_tokens: int, measured: bool = True) -> int:
    """The tokens one step holds (prompts x samples x (prompt + new tokens)); refused when even
    :data:`BATCH_BYTES_PER_TOKEN` per token exceeds ``memory``, naming the factor that does it.
    ``measured``: ``prompt_tokens`` is the longest prompt measured, not a lower bound."""
    values = {k: int(_select(cfg, k)) for k in _STEP_KEYS}

    def tokens(v: dict[str, int]) -> int:
        return v["data.prompts_per_step"] * v["rollout.n"] * (prompt_tokens + v["rollout.max_new_tokens"])

    total = tokens(values)
    if memory is not None and total * BATCH_BYTES_PER_TOKEN > memory:
        key = min(_STEP_KEYS, key=lambda k: tokens({**values, k: min(values[k], _STEP_KEYS[k])}))
        raise ConfigError(
            f"{key}={values[key]}: a step holds data.prompts_per_step {values['data.prompts_per_step']} x rollout.n "
            f"{values['rollout.n']} x ({'' if measured else 'at least '}{prompt_tokens} prompt + "
            f"{values['rollout.max_new_tokens']} new) tokens = "
            f"{_count(total)} tokens, at least {_bytes(total * BATCH_BYTES_PER_TOKEN)} "
            f"({BATCH_BYTES_PER_TOKEN} bytes each), more than this machine's {_bytes(memory)} (RAM, swap and GPUs)",
            key=key)
    return total


def _culprit(estimate: Callable[[Any], int], settings: Any, defaults: dict[str, Any], *, prefix: str) -> str:
    """The key whose reset to its default shrinks ``estimate(settings)`` most: the one to change."""
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(settings)

    def with_default(name: str) -> int:
        trial = OmegaConf.create({**base, name: defaults[name]})
        return estimate(trial)

    sizes = [n for n, v in base.items() if isinstance(v, int) and not isinstance(v, bool) and n in defaults
             and isinstance(defaults[n], int) and v > defaults[n]]
    return prefix + min(sizes or list(base), key=with_default)


# ------------------------------------------------------------------------------ prompts --

def measure_prompts(cfg: Any, task: Any, facts: ModelFacts, *, multi_turn: bool = False) -> tuple[int, int]:
    """The longest prompt of the first steps (up to :data:`PROMPTS_CHECKED` prompts, made with the
    trainer's seeds), checked and tokenized as the trainer does; refused when the task returns
    other than the prompts asked for (none, too few, not :class:`~rlcore.tasks.TaskPrompt`), or
    the longest and ``rollout.max_new_tokens`` exceed the model's positions. Returns (longest
    prompt in tokens, prompts measured)."""
    from rlcore.tasks import make_prompts

    per_step = int(cfg.data.prompts_per_step)
    steps = max(1, min(int(cfg.training.steps), PROMPTS_CHECKED // max(per_step, 1)))
    longest, measured, where = 0, 0, ""
    for step in range(steps):
        rng = random.Random(int(cfg.training.seed) * 1_000_003 + step)  # as Trainer._prompts
        try:
            prompts = make_prompts(task, rng, min(per_step, PROMPTS_CHECKED), f"step {step}")
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's task
            raise ConfigError(f"data.task: {cfg.data.task}: make_prompts(rng, {per_step}) raised "
                              f"{type(exc).__name__}: {_one_line(exc)} (at step {step})", key="data.task") from exc
        texts = {i: p.text for i, p in enumerate(prompts)}
        if not texts:
            continue
        ids = _tokenize(cfg, facts, texts, step)
        measured += len(ids)
        for i, row in zip(texts, ids, strict=True):
            if not row and texts[i].strip():
                _no_tokens(cfg, facts, texts[i], f"prompt {i} of step {step}")
            if len(row) > longest:
                longest, where = len(row), f"prompt {i} of step {step}"
    limit, new = facts.max_positions, int(cfg.rollout.max_new_tokens)
    total, how = longest_conversation(cfg, longest, multi_turn)
    if limit is not None and total > limit:
        if not multi_turn:
            key = "data.task" if longest >= limit else "rollout.max_new_tokens"
            raise ConfigError(f"{key}: {where} is {longest} tokens, + rollout.max_new_tokens {new} = {longest + new}, "
                              f"more than the model's {limit} positions ({facts.source} max_position_embeddings); "
                              f"shorten the prompts or lower rollout.max_new_tokens", key=key)
        env = cfg.environment
        if longest >= limit:
            key, fix = "data.task", "shorten the prompts"
        elif int(env.max_total_tokens) and total == max(int(env.max_total_tokens), longest + 1):
            key, fix = "environment.max_total_tokens", f"lower environment.max_total_tokens to at most {limit}"
        elif longest + new > limit:
            key, fix = "rollout.max_new_tokens", f"lower rollout.max_new_tokens (one turn already exceeds {limit})"
        else:
            key, fix = "environment.max_turns", (f"lower environment.max_turns (or environment.observation_tokens), "
                                                 f"or set environment.max_total_tokens to at most {limit}")
        raise ConfigError(f"{key}: a conversation of environment {env.name!r} can reach {how} = {total} tokens "
                          f"({where} is the longest prompt), more than the model's {limit} positions "
                          f"({facts.source} max_position_embeddings); {fix}", key=key)
    return longest, measured


def measure_dataset(cfg: Any, task: Any, facts: ModelFacts, report: PreflightReport) -> tuple[int, int]:
    """The prompts of ``data.train_files`` (and ``data.val_files``) rendered with the model's
    tokenizer (a conversation through its chat template; the first row's error comes first) and
    measured against the context, as the trainer does: longer rows are filtered or refused
    (``data.overlong``). Returns (longest kept prompt in tokens, prompts kept)."""
    from rlcore.datasets import context_limit

    limit = context_limit(cfg, facts.max_positions)
    for source in (task.source, task.val):
        if source is None:
            continue
        source.prepare(facts.tokenizer, limit, str(cfg.data.overlong))
        report.data.append(source.summary(limit))
    return task.source.longest, len(task.source.kept)


def _tokenize(cfg: Any, facts: ModelFacts, texts: dict[int, str], step: int) -> list[list[int]]:
    """``texts`` tokenized in one call (as the trainer does); text the tokenizer cannot take (a
    lone surrogate, which is not encodable) is refused naming the prompt."""
    try:
        return facts.tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"]
    except Exception as exc:  # noqa: BLE001 - find the prompt it cannot take
        for i, text in texts.items():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as bad:
                raise ConfigError(f"data.task: prompt {i} of step {step} from {cfg.data.task} holds "
                                  f"{text[bad.start]!r} at {bad.start}, which is not encodable text (a lone "
                                  f"surrogate): {text[:60]!r}", key="data.task") from exc
        raise ConfigError(f"data.task: the tokenizer of {facts.source} cannot take the prompts of step {step} from "
                          f"{cfg.data.task}: {type(exc).__name__}: {_one_line(exc, 200)}", key="data.task") from exc


def longest_conversation(cfg: Any, longest_prompt: int, multi_turn: bool) -> tuple[int, str]:
    """The most tokens one sample's context can reach, and how that adds up (for messages): the
    longest prompt + ``rollout.max_new_tokens``; in a ``multi_turn`` environment the prompt, every
    turn (``environment.max_turns`` x ``rollout.max_new_tokens``) and an observation of at most
    ``environment.observation_tokens`` between turns, capped by ``environment.max_total_tokens``
    where set (rlcore.environments.conversation cuts every turn to fit it; the first turn gets at
    least one token, so a prompt at the cap goes one past it)."""
    new = int(cfg.rollout.max_new_tokens)
    if not multi_turn:
        return longest_prompt + new, f"longest prompt {longest_prompt} tokens + rollout.max_new_tokens {new}"
    env = cfg.environment
    turns, observation, cap = int(env.max_turns), int(env.observation_tokens), int(env.max_total_tokens)
    uncapped = longest_prompt + turns * new + (turns - 1) * observation
    how = (f"longest prompt {longest_prompt} + environment.max_turns {turns} x rollout.max_new_tokens {new} + "
           f"{turns - 1} x environment.observation_tokens {observation}")
    if cap and max(cap, longest_prompt + 1) < uncapped:
        return max(cap, longest_prompt + 1), f"{how}, capped by environment.max_total_tokens {cap}"
    return uncapped, how


def _no_tokens(cfg: Any, facts: ModelFacts, text: str, where: str) -> None:
    """A prompt with text that tokenizes to nothing: the tokenizer is not the model's (transformers
    builds an empty one for a directory without tokenizer files) or the task's words are not in it."""
    key = "engine.model.path" if cfg.engine.model.path else "data.task"
    raise ConfigError(f"{key}: the tokenizer of {facts.source} ({len(facts.tokenizer)} tokens) turns {where} "
                      f"({text[:60]!r}) into no tokens; a model directory must hold its tokenizer's files", key=key)


# ------------------------------------------------------------------------------ helpers --

def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key)



def _count(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1000:
        return str(n)
    exp = min(int(math.log10(n)) // 3, 5)
    return f"{n / 1000 ** exp:.3g}{' KMGTP'[exp]}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return f"{n:.3g} PB"
