"""Hypothesis campaign over what users and plugins hand to rlcore: configs (types, ranges,
unknown keys), packing (empty, single-token, very long, all-masked), bucketing (tensors larger
than a bucket, zero-size tensors, odd dtypes) and routes (wrong shapes, duplicates,
out-of-range ids). The rule: an input is either accepted, and then it behaves (invariants
checked), or refused with one of rlcore's errors (rlcore.errors), never another exception.

What the campaign found and how it was fixed is in docs/reliability.md. ``max_examples`` is
bounded so the file runs in well under a minute on the CI machine; set
``HYPOTHESIS_PROFILE=campaign`` for the long run recorded there."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlcore.batch import PackedBatch, sample_routes
from rlcore.errors import RLCoreError
from rlcore.preflight import MAX_LR
from rlcore.sync import iter_buckets, tensor_checksum

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("campaign", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _rlcore_error_or_ok(fn, *args, **kw):
    """Run ``fn``; return its result, or None when it raised an rlcore error. Anything else fails."""
    try:
        return fn(*args, **kw)
    except RLCoreError:
        return None


# ---------------------------------------------------------------------------------- configs ----
# Three kinds of document: arbitrary ones (any key, any value: accepted or refused, never a crash),
# valid ones built from the schema (each leaf's type, its choices in config._CHOICES, its range in
# config._RANGES and the checks elsewhere mirrored in _MORE_RANGES, the cross-key rules in
# valid_documents): every one is accepted and runs preflight clean; and a valid one with one key
# mutated (unknown key, wrong type, out of range, absurd size): every one is refused with a
# ConfigError that names that key.

def _leaves() -> dict[str, Any]:
    """Every leaf of core's schema and its default (``rollout.n``: 8)."""
    from omegaconf import OmegaConf

    from rlcore.config import RunConfig

    out: dict[str, Any] = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = node

    walk("", OmegaConf.to_container(OmegaConf.structured(RunConfig)))
    return out


DEFAULTS = _leaves()
KNOWN = list(DEFAULTS)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "k3", "token-mean", "grpo", "stop", "skip", "rlcore.tasks:successor", "1e400", "-1"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=2))
keys = st.one_of(st.sampled_from(KNOWN), st.sampled_from(KNOWN).map(lambda k: k + "x"),
                 st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}", fullmatch=True))


def _nest(flat: dict) -> dict:
    root: dict = {}
    for key, val in flat.items():
        node = root
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = val
    return root


def _load(doc_path=None, overrides=(), *, preflight=True):
    """Validate, resolve and (``preflight``) run rlcore check's preflight, as ``rlcore check`` does."""
    from rlcore.manager import PluginManager
    from rlcore.preflight import preflight as run_preflight
    from rlcore.stack import load_config, resolve

    pm = PluginManager(autoload=False)
    pm.load_builtins()
    cfg, pm = load_config(doc_path, overrides, plugins=pm)
    stack = resolve(cfg, pm)
    if preflight:
        run_preflight(stack)
    return stack


def _check_accepted(stack) -> None:
    """An accepted config is one the run can use: every float finite, every count positive."""
    from omegaconf import OmegaConf

    from rlcore.config import training_fingerprint

    cfg = stack.config
    flat = training_fingerprint(cfg)
    for k, v in flat.items():
        if isinstance(v, float):
            assert math.isfinite(v), f"{k}={v} accepted"
    assert cfg.training.on_nonfinite in ("stop", "skip")
    assert cfg.output.keep_checkpoints >= 1 and cfg.output.checkpoint_every >= 0
    assert 0 < int(cfg.sync.bucket_mb * (1 << 20)) < 2**63
    assert OmegaConf.to_yaml(cfg)


def _write(tmp_path_factory, flat: dict) -> str:
    import yaml

    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(_nest(flat)))
    return str(path)


def _names_a_given_key(err: Exception, given: list[str]) -> bool:
    """A refusal points at the document: its key (or its message) is a key given, or a section or a
    leaf of one (``training: 5`` is refused as ``training``, ``training: {}`` as ``training.steps``)."""
    from rlcore.errors import ConfigError

    key = err.key if isinstance(err, ConfigError) else None
    related = [g for g in given if key and (key == g or key.startswith(g + ".") or g.startswith(key + "."))]
    return bool(related) or any(g in str(err) for g in given)


def _accepted_or_refused_naming_a_key(load, given: list[str]):
    from rlcore.errors import ConfigError

    try:
        return load()
    except ConfigError as e:
        assert _names_a_given_key(e, given), f"refusal names none of {given}: {e!r} (key {e.key!r})"
    except RLCoreError:
        pass
    return None


@given(st.dictionaries(keys, values, max_size=4))
def test_config_documents_are_accepted_or_refused_with_a_config_error(tmp_path_factory, flat):
    try:
        path = _write(tmp_path_factory, flat)
    except Exception:  # noqa: BLE001 - yaml cannot write it: not an input a user can give
        assume(False)
    stack = _accepted_or_refused_naming_a_key(lambda: _load(path), list(flat))
    if stack is not None:
        _check_accepted(stack)


@given(st.lists(st.tuples(keys, st.text(max_size=10)), max_size=3))
def test_command_line_overrides_are_accepted_or_refused_with_a_config_error(pairs):
    stack = _accepted_or_refused_naming_a_key(lambda: _load(None, [f"{k}={v}" for k, v in pairs]),
                                              [k for k, _ in pairs])
    if stack is not None:
        _check_accepted(stack)


# ----------------------------------------------------------------------- valid documents ----

#: numeric keys checked outside config._RANGES (config._check_values, _resolve_algorithm,
#: cluster_settings.check_cluster), mirrored here: (low, high, low inclusive, high inclusive)
_MORE_RANGES = {
    **{k: (1, math.inf, True, False) for k in ("rollout.n", "rollout.max_new_tokens", "training.micro_batch_tokens",
                                               "data.prompts_per_step", "training.steps")},
    "rollout.top_p": (0.0, 1.0, False, True),
    "algorithm.norm_tokens": (0, math.inf, True, False),
    **{f"cluster.{k}": (1, math.inf, True, False) for k in (
        "trainer.dp", "trainer.tp", "trainer.ep", "trainer.pp", "rollout.replicas")},
    **{f"cluster.{k}": (0.0, math.inf, False, False) for k in ("timeout_s", "rollout.timeout_s")},
    **{f"cluster.{r}.resources.{k}": (0.0, math.inf, True, False) for r in ("trainer", "rollout")
       for k in ("num_cpus", "num_gpus")},
}


def _ranges() -> dict[str, tuple]:
    from rlcore import config as cfgmod

    return {**cfgmod._RANGES, **_MORE_RANGES}


def _choices() -> dict[str, tuple]:
    from rlcore import cluster_settings
    from rlcore import config as cfgmod

    return {**cfgmod._CHOICES, "cluster.placement": cluster_settings.PLACEMENTS}


#: realistic upper ends for generated sizes (valid documents must also pass preflight on a laptop)
_SIZE_CAPS = {"rollout.n": 64, "data.prompts_per_step": 128, "rollout.max_new_tokens": 128, "data.prompt_len": 32,
              "training.steps": 500, "engine.model.tiny.hidden_size": 256, "engine.model.tiny.num_layers": 4,
              "engine.model.tiny.intermediate_size": 512, "engine.model.tiny.num_experts": 16,
              "engine.model.tiny.moe_intermediate_size": 128, "engine.model.tiny.head_dim": 64,
              "engine.model.tiny.num_heads": 8, "engine.model.tiny.vocab_size": 4096, "lora.rank": 64}
#: key prefixes whose valid values valid_documents sets by cross-key rules
RULED = ("engine.model.tiny.", "algorithm.", "cluster.", "rollout.", "loop.", "environment.")
#: keys the generator leaves at their defaults, and why (each is tested elsewhere)
HELD = {
    "plugins": "changes the schema itself (tests/test_examples.py, core/tests/test_stack.py)",
    "engine.name": "core's only engine; others come with their plugins",
    "forward.name": "core's only head", "rollout.backend": "core's only rollout backend",
    "engine.model.path": "needs a model directory (core/tests/test_preflight.py)",
    "data.task": "a module path (core/tests/test_preflight.py)", "data.reward": "a module path (same)",
    "output.dir": "where a run writes: check never touches it",
    "lora.target_modules": "names of the model's layers (core/tests/test_lora.py)",
    **{f"data.{k}": "names dataset files and their columns (core/tests/test_datasets.py)"
       for k in ("train_files", "val_files", "prompt_key", "answer_key")},
    **{k: "validation runs on data.val_files (tests/test_gsm8k_example.py)" for k in DEFAULTS
       if k.startswith("validation.")},
    **{k: "a tracker needs its package and writes outside check (core/tests/test_tracking.py)" for k in DEFAULTS
       if k.startswith("tracking.")},
}


def _number(key: str, default: Any, lo: float, hi: float, lo_in: bool, hi_in: bool):
    """Valid values of a numeric key: in its range, capped at a realistic size."""
    cap = _SIZE_CAPS.get(key)
    if isinstance(default, bool):
        raise AssertionError(key)
    if isinstance(default, int) or (default is None and key.endswith("seed")):
        low = int(lo) + (0 if lo_in else 1) if math.isfinite(lo) else -(2**31)
        high = int(hi) - (0 if hi_in else 1) if math.isfinite(hi) else max(cap or 10_000, low)
        high = min(high, cap) if cap else high
        return st.integers(low, max(low, high))
    low = lo if math.isfinite(lo) else -1e6
    high = min(hi, 1e6) if math.isfinite(hi) else 1e6
    return st.floats(low, high, exclude_min=not lo_in, exclude_max=not hi_in or not math.isfinite(hi),
                     allow_nan=False, allow_infinity=False)


def _leaf_strategy(key: str):
    """A key's valid values from the schema alone (None: a key the cross-key rules below set)."""
    default = DEFAULTS[key]
    if key in _choices():
        return st.sampled_from(list(_choices()[key]))
    if isinstance(default, bool):
        return st.booleans()
    if key in _ranges():
        return _number(key, default, *_ranges()[key])
    return None


@st.composite
def valid_documents(draw) -> dict[str, Any]:
    """A flat document (``{"rollout.n": 4, ...}``) of a random subset of core's keys, every value
    valid alone and together. Keys not drawn keep their defaults."""
    doc: dict[str, Any] = {}

    def put(key, strategy):
        if draw(st.booleans()):
            doc[key] = draw(strategy)

    def value(key):
        return doc.get(key, DEFAULTS[key])

    for key in KNOWN:
        if key in HELD or key.startswith(RULED):
            continue
        if key == "training.betas":
            put(key, st.lists(st.floats(0.0, 0.999), min_size=2, max_size=2))
        elif key == "engine.device":
            put(key, st.sampled_from(["cpu", "auto"]))
        elif key == "engine.model.dtype":
            put(key, st.sampled_from(["float32", "bfloat16", "float16"]))
        elif key == "sync.name":
            put(key, st.sampled_from(["inproc", "disk"]))
        elif key == "sync.delta":  # needs a sync that declares delta (inproc; disk is refused naming sync.delta)
            put(key, st.booleans() if value("sync.name") == "inproc" else st.just(False))
        elif key == "training.lr":  # preflight.check_optimizer: below MAX_LR, and lr x weight_decay < 1
            put(key, st.floats(0.0, MAX_LR, exclude_max=True))
        elif key == "training.weight_decay":
            put(key, st.floats(0.0, 1.0, exclude_max=True))
        else:
            strategy = _leaf_strategy(key)
            assert strategy is not None, f"{key}: no rule makes its valid values; add one, or hold it (HELD)"
            put(key, strategy)

    # the tiny model: shapes a model can have
    t = "engine.model.tiny."
    put(t + "arch", st.sampled_from(["qwen2", "qwen2_moe", "qwen3_moe"]))
    for k in ("hidden_size", "num_layers", "intermediate_size", "num_experts", "moe_intermediate_size",
              "init_std", "seed", "num_heads"):
        put(t + k, _leaf_strategy(t + k))
    put(t + "tie_word_embeddings", st.booleans())
    put(t + "num_kv_heads", st.sampled_from([d for d in range(1, value(t + "num_heads") + 1)
                                             if value(t + "num_heads") % d == 0]))
    put(t + "head_dim", st.integers(1, 32).map(lambda h: 2 * h))  # RoPE: even
    put(t + "topk", st.integers(1, value(t + "num_experts")))
    if value(t + "topk") > value(t + "num_experts"):  # the default topk against fewer experts drawn
        doc[t + "topk"] = draw(st.integers(1, value(t + "num_experts")))
    put(t + "vocab_size", st.one_of(st.just(0), st.integers(14, 4096)))  # 0 or at least the task's 14 tokens
    if value(t + "arch") == "qwen2":
        put(t + "mtp_layers", st.integers(0, 2))

    # rollout: the local backend's own settings hang together
    r = "rollout."
    for k in ("n", "top_p", "top_k", "max_new_tokens", "release_kv_cache", "seed", "local_update"):
        put(r + k, _leaf_strategy(r + k))
    from rlcore.preflight import MIN_TEMPERATURE

    put(r + "temperature", st.one_of(st.just(MIN_TEMPERATURE), st.floats(0.05, 2.0)))
    put(r + "draft_depths", st.integers(0, value(t + "mtp_layers")))
    if not value(r + "draft_depths"):
        put(r + "return_routed_experts", st.booleans())

    # algorithm: a correction needs the recomputed log-probs; mask_low below mask_high
    a = "algorithm."
    from rlcore.config import builtin_algorithms

    put(a + "name", st.sampled_from(sorted(builtin_algorithms())))
    for k in ("loss_agg", "norm_tokens", "kl_coef", "kl_estimator", "kl_in", "entropy_coef", "updates_per_step",
              "mismatch.level"):
        put(a + k, _leaf_strategy(a + k))
    put(a + "mismatch.tis_cap", st.one_of(st.just(0.0), st.floats(1.0, 10.0)))
    put(a + "mismatch.mask_low", st.one_of(st.just(0.0), st.floats(0.01, 0.9)))
    put(a + "mismatch.mask_high", st.one_of(st.just(0.0), st.floats(1.1, 10.0)))
    corrects = any(value(a + "mismatch." + k) for k in ("tis_cap", "mask_low", "mask_high"))
    put(a + "old_logprobs", st.sampled_from(["auto", "recompute"] + ([] if corrects else ["rollout"])))

    # cluster: one process (core's local launcher; the ray launcher's checks: plugins/ray/tests)
    c = "cluster."
    for k in ("placement", "timeout_s", "rollout.timeout_s", "trainer.resources.num_cpus", "trainer.resources.num_gpus", "rollout.resources.num_cpus",
              "rollout.resources.num_gpus"):
        put(c + k, _leaf_strategy(c + k))
    seed_per_prompt = st.sampled_from([None, True] if value(c + "rollout.replicas") > 1 else [None, True, False])
    put(r + "seed_per_prompt", seed_per_prompt)

    # loop: the overlapped modes (rlcore.loop_settings): ahead_steps only for async, never below max_staleness
    lp = "loop."
    put(lp + "mode", st.sampled_from(["sync", "one_step_off", "async"]))
    put(lp + "max_staleness", st.integers(0, 4))
    if value(lp + "mode") == "async":
        put(lp + "ahead_steps", st.integers(value(lp + "max_staleness"), 6))
    put(lp + "stale", st.sampled_from(["drop", "rescore"]))
    put(lp + "in_flight", st.sampled_from(["abort", "keep"]))
    for k in ("samples_s", "trainer_s", "push_s", "join_s"):
        put(lp + "timeouts." + k, st.floats(0.001, 1e6))

    # environment (rlcore.environment_settings): multi-turn is refused beside ReMax's greedy baseline;
    # a tools conversation is bounded by max_total_tokens so that it fits the tiny model's positions
    e = "environment."
    one_turn = builtin_algorithms()[value(a + "name")].single_turn  # AlgorithmSpec.single_turn (ReMax's)
    put(e + "name", st.sampled_from(["single_turn"] if one_turn else ["single_turn", "tools"]))
    put(e + "max_turns", st.integers(1, 4))
    put(e + "max_tool_calls", st.integers(0, 4))
    if value(e + "name") == "tools":
        doc[e + "max_total_tokens"] = draw(st.integers(64, 384))
    put(e + "tools", st.sampled_from([["calc"], []]))
    put(e + "tool_output_chars", st.integers(1, 4096))
    put(e + "observation_tokens", st.integers(1, 64))
    put(e + "tool_call_reward", st.floats(-1.0, 1.0))
    put(e + "tool_format", st.sampled_from(["words", "hermes"]))
    put(e + "observation_prefix", st.sampled_from(["result", "", "tool says"]))
    put(e + "tool_timeout_seconds", st.floats(0.1, 60.0))
    return doc


def test_every_schema_key_is_generated_or_held():
    """A new setting joins the campaign: its choices (config._CHOICES), its range (config._RANGES)
    or a rule in valid_documents; or a reason to hold it in HELD."""
    ruled = {k for k in KNOWN if k.startswith(RULED)}
    loose = [k for k in KNOWN if k not in HELD and k not in ruled and _leaf_strategy(k) is None
             and k not in ("training.betas", "engine.device", "engine.model.dtype", "sync.name")]
    assert not loose, f"no valid values known for {loose}"
    assert set(HELD) <= set(KNOWN), f"held keys that are gone: {set(HELD) - set(KNOWN)}"


def _same(given: Any, got: Any) -> bool:
    if isinstance(given, float) or isinstance(got, float):
        return got is not None and math.isclose(float(given), float(got), rel_tol=1e-12)
    return given == got


@given(valid_documents())
def test_valid_documents_are_accepted_as_given(tmp_path_factory, flat):
    """Every valid document passes validation, resolution and preflight, and holds what it was given
    (``auto`` values resolve to a choice)."""
    from omegaconf import OmegaConf

    stack = _load(_write(tmp_path_factory, flat))
    _check_accepted(stack)
    for key, given_value in flat.items():
        got = OmegaConf.select(stack.config, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        if given_value == "auto" or (key == "rollout.seed_per_prompt" and given_value is None):
            continue
        assert _same(given_value, got) if not isinstance(given_value, list) else \
            all(_same(a, b) for a, b in zip(given_value, got, strict=True)), f"{key}: gave {given_value!r}, got {got!r}"


# -------------------------------------------------------------------- mutated documents ----

#: valid-but-absurd values: each needs more memory than any machine has (a lower bound in
#: rlcore.preflight), or a temperature the trainer cannot divide by. Sizes of the tiny model
#: matter only where its arch uses them (dense MLP: qwen2 and qwen2_moe's shared expert; experts: MoE).
ABSURD = {"rollout.n": 10**13, "data.prompts_per_step": 10**13, "rollout.max_new_tokens": 10**13,
          "engine.model.tiny.hidden_size": 10**13, "engine.model.tiny.num_layers": 10**13,
          "engine.model.tiny.vocab_size": 10**13, "engine.model.tiny.intermediate_size": 10**13,
          "engine.model.tiny.num_experts": 10**13, "engine.model.tiny.moe_intermediate_size": 10**13,
          "rollout.temperature": 1e-30}
_USED_BY = {"engine.model.tiny.intermediate_size": ("qwen2", "qwen2_moe"),
            "engine.model.tiny.num_experts": ("qwen2_moe", "qwen3_moe"),
            "engine.model.tiny.moe_intermediate_size": ("qwen2_moe", "qwen3_moe")}


def _wrong_type(key: str):
    default = DEFAULTS[key]
    if isinstance(default, list):
        return "not-a-list"
    if isinstance(default, (bool, int, float)) or default is None and key in _ranges():
        return st.sampled_from(["lots", {"a": 1}, [1, 2]])
    if key in _choices():
        return st.sampled_from(["no-such-choice", {"a": 1}])
    return None


def _out_of_range(key: str):
    lo, hi, lo_in, hi_in = _ranges()[key]
    bad = []
    if math.isfinite(lo):
        bad.append(lo - 1 if lo_in else lo)
    if math.isfinite(hi):
        bad.append(hi + 1 if hi_in else hi)
    if isinstance(DEFAULTS[key], float):
        bad += [math.nan, math.inf]
    return st.sampled_from(bad) if bad else None


@st.composite
def mutated_documents(draw) -> tuple[dict[str, Any], str, str]:
    """A valid document with one key made wrong: (document, the key, the kind of mutation)."""
    doc = draw(valid_documents())
    kind = draw(st.sampled_from(["unknown key", "wrong type", "out of range", "absurd"]))
    if kind == "unknown key":
        parent = draw(st.sampled_from(sorted({k.rsplit(".", 1)[0] for k in KNOWN if "." in k})))
        key = f"{parent}.{draw(st.sampled_from(['nn', 'temprature', 'x']))}"
        return {**doc, key: 1}, key, kind
    if kind == "wrong type":
        key = draw(st.sampled_from([k for k in KNOWN if k not in HELD and _wrong_type(k) is not None]))
        bad = _wrong_type(key)
        return {**doc, key: draw(bad) if not isinstance(bad, str) else bad}, key, kind
    if kind == "out of range":
        key = draw(st.sampled_from([k for k in sorted(_ranges()) if _out_of_range(k) is not None]))
        return {**doc, key: draw(_out_of_range(key))}, key, kind
    arch = doc.get("engine.model.tiny.arch", DEFAULTS["engine.model.tiny.arch"])
    key = draw(st.sampled_from([k for k in ABSURD if arch in _USED_BY.get(k, (arch,))]))
    if key == "engine.model.tiny.num_experts":
        doc["engine.model.tiny.topk"] = 1  # any topk is valid against that many experts
    return {**doc, key: ABSURD[key]}, key, kind


@given(mutated_documents())
def test_a_document_with_one_bad_key_is_refused_naming_that_key(tmp_path_factory, mutated):
    from rlcore.errors import ConfigError

    flat, key, kind = mutated
    path = _write(tmp_path_factory, flat)
    with pytest.raises(ConfigError) as e:
        _load(path)
    assert key in str(e.value), f"{kind} {key}={flat[key]!r}: refused as {e.value}"
    assert e.value.key in (None, key), f"{kind} {key}={flat[key]!r}: refused naming key {e.value.key!r}"


@pytest.mark.parametrize("override", [
    "training.lr=nan", "training.lr=-1", "rollout.temperature=inf", "sync.bucket_mb=1e300", "training.seed=-1",
    "training.betas=[0.9]", "training.betas=[0.9,1.5]", "output.keep_checkpoints=0", "training.on_nonfinite=ignore",
    "algorithm.kl_coef=-0.1", "training.grad_clip=nan", "output.checkpoint_every=-1", "algorithm.clip_low=1.5",
    "training.betas={}", "training=[]", "engine.model.tiny=[1]", "engine.model.tiny.init_std=INF",
    "engine.model.tiny.hidden_size=0", "training.betas=[0.9,nan]",
    # found by the valid-document generator: a bucket under one byte (the first push failed), a seed
    # torch cannot take (the model's creation raised ValueError)
    "sync.bucket_mb=1e-135", "engine.model.tiny.seed=1180591620717411303424",
])
def test_out_of_range_values_name_their_key(override):
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _load(None, [override])
    assert override.split("=")[0] in str(e.value)


# ---------------------------------------------------------------------------------- packing ----

token_ids = st.integers(min_value=0, max_value=50_000)
sequences = st.lists(st.lists(token_ids, min_size=0, max_size=12), min_size=0, max_size=6)


@st.composite
def pack_inputs(draw):
    seqs = draw(st.one_of(sequences, st.lists(st.lists(token_ids, min_size=2000, max_size=5000), max_size=2)))
    starts = [draw(st.one_of(st.integers(min_value=1, max_value=max(len(s), 1)),  # valid
                             st.integers(min_value=-2, max_value=len(s) + 2)))     # maybe not
              for s in seqs]
    if draw(st.booleans()):
        starts = [len(s) for s in seqs]  # all-masked: empty responses
    return seqs, starts, draw(st.integers(min_value=-1, max_value=8)), draw(st.integers(min_value=-1, max_value=64))


@given(pack_inputs())
def test_packing_is_exact_or_refused(inp):
    seqs, starts, align, max_tokens = inp
    batch = _rlcore_error_or_ok(
        PackedBatch.pack, seqs, starts, align=align,
        target_fields={"adv": [torch.full((len(s),), 0.5) for s in seqs]},
    )
    if batch is None:
        return
    assert [p.tolist() for p in batch.unpack(batch.input_ids)] == seqs
    assert batch.num_loss_tokens == sum(len(s) - rs for s, rs in zip(seqs, starts))
    assert batch.num_tokens % max(align, 1) == 0
    labels = batch.labels()
    for seq, piece in zip(seqs, batch.unpack(labels)):
        assert piece[:-1].tolist() == seq[1:], "rolling never crosses a sequence boundary"
    mbs = _rlcore_error_or_ok(batch.micro_batches, max_tokens)
    if mbs is None:
        assert max_tokens < 1
        return
    assert sum(mb.num_seqs for mb in mbs) == batch.num_seqs
    assert sum(mb.num_tokens for mb in mbs) == batch.num_tokens


@given(st.one_of(
    st.just([[]]), st.just([[5]]), st.just([[1.5, 2.0]]), st.just([[-3, 4]]), st.just([[[1, 2], [3, 4]]]),
    st.just([[True, False]]), st.just([["a", "b"]]), st.just([[2**70, 1]]),
))
def test_odd_token_ids_are_refused_or_packed(seqs):
    batch = _rlcore_error_or_ok(PackedBatch.pack, seqs, [1] * len(seqs))
    if batch is not None:
        assert batch.input_ids.dtype == torch.long and int(batch.input_ids.min()) >= 0


@given(st.lists(st.one_of(st.just(0), st.integers(1, 5)), min_size=1, max_size=4), st.sampled_from([0, 1, 2]))
def test_target_and_input_fields_of_any_shape_are_refused_or_placed(rows, ndim):
    seqs = [[1, 2, 3, 4]] * len(rows)
    vals = [torch.zeros((r,) + (2,) * (ndim - 1)) if ndim else torch.tensor(float(r)) for r in rows]
    for kind in ("target_fields", "input_fields"):
        batch = _rlcore_error_or_ok(PackedBatch.pack, seqs, [2] * len(seqs), **{kind: {"f": vals}})
        if batch is not None:
            assert batch.fields["f"].shape[0] == batch.num_tokens


# -------------------------------------------------------------------------------- bucketing ----

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.bool,
          torch.int64, torch.complex64, torch.float8_e4m3fn, torch.uint16, torch.int32]


@st.composite
def named_tensors(draw):
    n = draw(st.integers(min_value=0, max_value=8))
    out = []
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=3)))
        t = torch.zeros(shape, dtype=torch.float32).uniform_(-1, 1).to(dtype) if dtype != torch.bool else \
            torch.zeros(shape, dtype=torch.bool)
        if len(shape) == 2 and draw(st.booleans()):
            t = t.t()  # non-contiguous
        out.append((draw(st.sampled_from([f"w{i}", "w0", "layers.0.q", ""])), t))
    return out


@given(named_tensors(), st.integers(min_value=-1, max_value=600), st.one_of(st.none(), st.integers(-1, 20)))
def test_buckets_round_trip_every_tensor_or_refuse(tensors, bucket_bytes, align):
    buckets = _rlcore_error_or_ok(lambda: list(iter_buckets(tensors, bucket_bytes, align_bytes=align)))
    if buckets is None:
        return
    assert sum(len(b.metas) for b in buckets) == len(tensors)
    by_pos = {}
    for b in buckets:
        for m in b.metas:
            by_pos.setdefault(m.name, []).append(b.view(m))
    def raw(x):
        return x.contiguous().reshape(-1).view(torch.uint8)

    for name, t in tensors:
        match = [g for g in by_pos[name] if g.shape == t.shape and g.dtype == t.dtype and torch.equal(raw(g), raw(t))]
        assert match, f"{name} {tuple(t.shape)} {t.dtype} arrived intact"
    for b in buckets:  # checksums read views in place: those at offsets not a multiple of 4 too
        for _, view in b.tensors():
            if view.storage_offset() * view.element_size() % 4:
                assert tensor_checksum(view) == tensor_checksum(view.clone())
    for b in buckets:  # over capacity only for one tensor (or one same-name group) travelling alone
        assert b.nbytes <= bucket_bytes or len({m.name for m in b.metas}) == 1


@given(st.sampled_from(["sparse", "meta", "not a tensor", "scalar"]))
def test_odd_objects_in_the_weight_stream_are_refused_or_bucketed(kind):
    t = {"sparse": torch.eye(3).to_sparse(), "meta": torch.empty(3, device="meta"), "not a tensor": [1.0],
         "scalar": torch.tensor(2.0)}[kind]
    buckets = _rlcore_error_or_ok(lambda: list(iter_buckets([("w", t)], 64)))
    if buckets is not None:
        (b,) = buckets
        assert torch.equal(b.view(b.metas[0]), t)


# ----------------------------------------------------------------------------------- routes ----

class _Layout:
    """The duck type sample_routes needs (rlcore.types.RouteLayout's select/num_experts/topk)."""

    def __init__(self, layers, topk, num_experts, num_hidden_layers):
        from rlcore.types import RouteLayout

        self.inner = RouteLayout(tuple(layers), topk, num_experts, num_hidden_layers)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@st.composite
def route_inputs(draw):
    num_experts = draw(st.integers(min_value=1, max_value=70_000))
    topk = draw(st.integers(min_value=1, max_value=4))
    hidden = draw(st.integers(min_value=1, max_value=4))
    layers = sorted(draw(st.sets(st.integers(0, hidden - 1), min_size=1, max_size=hidden)))
    seq_len = draw(st.integers(min_value=2, max_value=6))
    rows = draw(st.sampled_from([seq_len, seq_len - 1, seq_len + 1, 0]))
    shape = draw(st.sampled_from([(rows, hidden, topk), (rows, hidden, topk + 1), (rows, topk), (rows, hidden + 1, topk)]))
    ids = draw(st.lists(st.integers(min_value=-3, max_value=num_experts + 2), min_size=math.prod(shape),
                        max_size=math.prod(shape)))
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32]))
    raw = torch.tensor(ids, dtype=torch.int64).reshape(shape)
    raw = raw.to(dtype) if dtype != torch.int16 else raw.clamp(-32768, 32767).to(dtype)
    return _Layout(layers, topk, num_experts, hidden), raw, seq_len


@given(route_inputs())
def test_rollout_routes_are_checked_before_they_reach_a_batch(inp):
    layout, raw, seq_len = inp
    routes = _rlcore_error_or_ok(sample_routes, raw, layout, seq_len, "sample 0")
    if routes is None:
        return
    assert routes.shape[1:] == (layout.num_routed, layout.topk) and routes.shape[0] in (seq_len, seq_len - 1)
    assert not routes.is_floating_point()
    assert int(routes.min()) >= -1 and int(routes.max()) < layout.num_experts
    chosen = routes.long()
    for row in chosen.reshape(-1, layout.topk).tolist():
        picked = [e for e in row if e >= 0]
        assert len(picked) == len(set(picked)), f"duplicate experts {row} accepted"
    batch = PackedBatch.pack([list(range(seq_len))], [1], input_fields={"routes": [routes]})
    assert torch.equal(batch.fields["routes"][: routes.shape[0]].long(), chosen)


@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 9),
       st.lists(st.integers(-2, 10), min_size=0, max_size=40), st.sampled_from([torch.int64, torch.float32]))
def test_router_hook_answers_are_applied_or_refused(num_tokens, topk, num_experts, ids, dtype):
    from rlcore.engines.routing import apply_router_decision
    from rlcore.types import RouterDecision

    n = num_tokens * topk
    forced = torch.tensor((ids + [0] * n)[:n] if len(ids) >= n // 2 else ids, dtype=dtype)
    if forced.numel() == n:
        forced = forced.reshape(num_tokens, topk)
    native = torch.stack([torch.randperm(max(num_experts, topk))[:topk] for _ in range(num_tokens)])
    native = native.clamp(max=num_experts - 1)
    assume(all(len(set(r)) == topk for r in native.tolist()))
    out = _rlcore_error_or_ok(apply_router_decision, RouterDecision(indices=forced), native, layer=0,
                              num_experts=num_experts, topk=topk, num_tokens=num_tokens, to_rows=lambda x: x)
    if out is not None:
        assert out.shape == (num_tokens, topk) and int(out.min()) >= 0 and int(out.max()) < num_experts
