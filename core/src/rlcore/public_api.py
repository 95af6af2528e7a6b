"""rlcore's public API: the modules a plugin may import, each with what a plugin takes from it.

A plugin (first-party under ``plugins/`` or third-party) imports rlcore only through these
modules; everything else in ``rlcore`` is internal and may change or move without notice. The
list is defined here, once: docs/writing-plugins.md shows it as a table whose rows are exactly
these entries (same order, same text), and ``tests/test_public_api.py`` fails when a
first-party plugin's source (``plugins/*/src``) or the example plugin imports a core module
outside it, or a module of :data:`FOR_TESTS_ONLY` outside its tests.

Making a module public is deliberate: add it here with the one line a plugin author reads, and
the same row to the table. A module leaves the list only with a ``PLUGIN_API`` bump.
"""

from __future__ import annotations

#: module -> what a plugin takes from it (the row of docs/writing-plugins.md's table, verbatim)
PUBLIC_MODULES: dict[str, str] = {
    "rlcore": "`hookimpl`, `PLUGIN_API`",
    "rlcore.types": (
        "descriptors (`ForwardFnSpec`, `AlgorithmSpec`, `PluginSettings`, ...), the inputs and outputs of every "
        "hook (`MicroBatchContext`, `ModelOutput`, `PostprocessResult`, `AdvantageInput`, `TokenInputs`, ...), "
        "capabilities (`Cap`)"
    ),
    "rlcore.algorithms": (
        "the algorithm contract (`AlgorithmSpec`, `Algorithm`, `AdvantageInput`, `TokenInputs`, `PolicyLoss`) "
        "and core's own losses, estimators and their parts to reuse: `PPOClip`, `clip_branch`, `bounded_log_ratio`, "
        "`GRPOAdvantage`, `RLOOAdvantage`, `group_normalised`, `broadcast`, the PPO-clip settings and checks "
        "(`PPOClipSettings`, `GRPOSettings`, `check_clip`, `with_estimator`), ... "
        "([algorithms.md](algorithms.md#reusing-a-built-in-loss-or-estimator))"
    ),
    "rlcore.batch": "`PackedBatch`: the packed micro-batch your chain hooks receive",
    "rlcore.tasks": (
        "the task and reward contract of data.task / data.reward: `Task`, `TaskPrompt`, `RewardInput`, "
        "`load_callable`, the built-in `successor` / `successor_reward` ([tasks.md](tasks.md))"
    ),
    "rlcore.errors": (
        "the errors to raise: `ConfigError(message, key=...)` for a bad value, `RolloutError`, `WeightSyncError`, "
        "`BatchShapeError`; every one derives from `RLCoreError`"
    ),
    "rlcore.platforms": (
        "the device platform of a run: `run_device(ctx)` in a factory, `platform_for(device)` (its "
        "torch.distributed backend, `platform_for(device).set_device`), `TorchDevicePlatform` for a `platform` "
        "provider"
    ),
    "rlcore.heads": (
        "the reference head every forward_fn must match, to reuse or compare with: `reference_logprobs`, "
        "`ReferenceHead`; `check_head_input` refuses a malformed head input"
    ),
    "rlcore.distributed": (
        "autograd-aware collectives for a tensor-parallel head (Megatron's conventions): `copy_to_group`, "
        "`reduce_from_group`, `gather_from_sequence_parallel`, `all_reduce_max`, `group_size`, `group_rank`"
    ),
    "rlcore.sync": ("for weight syncs: the bucket builder (`iter_buckets`), checksums (`tensor_checksum`) and the "
                    "sender's checksums summed by the bucket fills (`SentChecksums`)"),
    "rlcore.lora": (
        "for a rollout backend that takes LoRA adapter pushes: `pushes_adapter(config, capabilities)` (the trainer's "
        "rule), `lora_on`, the adapter directory's names (`ADAPTER_DIR`, `ADAPTER_FILE`)"
    ),
    "rlcore.rollout_seeds": (
        "for a rollout backend: the sampling seeds every backend uses, `base_seed(config)` and `CallSeeds`"
    ),
    "rlcore.engines.routing": (
        "for an engine's MoE routers: `apply_router_decision` checks and applies a `router_hook` answer, "
        "`forward_state_of_router_call` and `in_backward` for activation recomputation"
    ),
    "rlcore.engines.hf_names": "for an engine: HF checkpoint names of a transformers model (`checkpoint_tensors`)",
    "rlcore.engines.mimo_layout": (
        "for an engine with MTP layers: the checkpoint layout it exports to (`tensor_names`, `ARCHITECTURE`, "
        "`NUM_LAYERS_KEY`)"
    ),
    "rlcore.engines.tiny": (
        "for an engine: the tiny models created locally (the embedded default): `tiny_config`, "
        "`make_tiny_model`, `make_tokenizer`"
    ),
    "rlcore.engines.varlen": (
        "for an engine's attention over packed sequences: `varlen_attention` (causal, per sequence boundaries, "
        "no padding), `varlen_backend` (which kernel a device and dtype get)"
    ),
    "rlcore.parallel.worker": (
        "for a launcher: a trainer rank's process entry (`run_rank`), the resolved config shipped to it "
        "(`config_yaml`, `stack_from_yaml`), `free_port`"
    ),
    "rlcore.preflight": (
        "for a launcher: `preflight(stack)`, the checks a run's build makes before it touches anything, to run "
        "before starting ranks elsewhere"
    ),
    "rlcore.testing.conformance": (
        "a conformance suite per provider hook (`ForwardFnConformance`, `RolloutBackendConformance`, "
        "`WeightSyncConformance`, `EngineConformance`), `float64_head` to compare a head with (section 4)"
    ),
    "rlcore.testing.algorithm_conformance": "`AlgorithmConformance`, the suite of an algorithm (section 4)",
    "rlcore.testing.launcher_conformance": "`LauncherConformance`, the suite of a launcher (section 4)",
    "rlcore.testing.environment_conformance": "`EnvironmentConformance`, the suite of an environment ([agents.md](agents.md)); `tool_environment` and `model_turn` for a tool's own tests",
    "rlcore.environments.tools": (
        "for an environment that runs tools: `Tool`, `ToolRegistry`, `call_tool` (each call bounded in time and "
        "output, every failure an observation), `CALC` (the calculator tool); for a `tool` provider: `Tool`, "
        "`MAX_TOOL_SECONDS` (the longest a tool limit may be) ([agents.md](agents.md))"
    ),
    "rlcore.testing.models": (
        "tiny HF model directories (`make_model_dir`) and what transformers computes from them (`hf_greedy`, "
        "`hf_token_logprobs`), to compare with"
    ),
    "rlcore.testing.imports": "`modules_loaded_by`: which heavy modules an import pulls in (section 3)",
    "rlcore.testing.runs": (
        "in tests: a run as the rlcore command starts it (`main(['train', config, ...])`, `Trainer(stack).run()`), "
        "what it wrote (`read_metrics`, `list_checkpoints`, `load_checkpoint`) and what two runs of one config "
        "must agree on (`comparable_metrics`)"
    ),
    "rlcore.manager": (
        "in tests: `PluginManager().activate([...])` loads plugins through their entry points, as `rlcore train` "
        "does; its typed calls (`PluginManager.step_end`, `PluginManager.algorithms`, ...) call hooks as core "
        "does (section 4)"
    ),
    "rlcore.stack": (
        "in tests: `load_config(path, overrides, plugins=pm)` validates a config against a manager's plugins, "
        "exactly as `rlcore check` does; `resolve(cfg, pm)` selects the providers"
    ),
}

#: public modules a plugin imports in its tests only, never in its source: core builds the manager
#: and the stack for a run, a plugin is handed what it needs through its hooks
FOR_TESTS_ONLY: frozenset[str] = frozenset({"rlcore.manager", "rlcore.stack", "rlcore.testing.runs"})
