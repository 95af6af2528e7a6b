"""Hook specifications: the whole plugin contract of rlcore.

Each spec says its kind by its decorator (docs/hooks.md has the lifecycle diagram):

* ``@provider(Descriptor, key=...)``: returns typed descriptors (:mod:`rlcore.types`) naming
  implementations. Every name must be unique across installed distributions; the config selects
  one by name.
* ``@chain``: runs every active plugin's implementation in the order the config's ``plugins:``
  list gives (``@chain(firstresult=True)``: stops at the first non-None answer).
* ``@declaration``: what a plugin declares about itself (its config section, its constraints).

:data:`PROVIDER_HOOKS`, :data:`CHAIN_HOOKS`, :data:`DECLARATION_HOOKS` and :data:`DESCRIPTORS`
are read from those decorators: adding a hook is its spec here and its section in docs/hooks.md
(a test fails when a spec is undocumented, unclassified or untested).

An implementation may accept fewer arguments than its spec (so adding an argument here is a
compatible change), never more. Chain hooks must not use ``tryfirst``/``trylast``: the order is
the user's, in the config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from rlcore.types import (
    AlgorithmSpec,
    EngineSpec,
    EnvironmentSpec,
    ForwardFnSpec,
    LauncherSpec,
    PlatformSpec,
    ProviderSpec,
    RolloutBackendSpec,
    ToolSpec,
    TrackerSpec,
    WeightSyncSpec,
)

if TYPE_CHECKING:  # pragma: no cover
    from rlcore.types import (
        Constraint,
        ForwardRequest,
        MicroBatchContext,
        ModelOutput,
        PluginSettings,
        PostprocessResult,
        RouterCall,
        RouterDecision,
        StepContext,
    )

PROJECT = "rlcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def _kind(kind: str, descriptor: type[ProviderSpec] | None = None, key: str | None = None, rule: str = "",
          **options: Any) -> Callable:
    def mark(spec: Callable) -> Callable:
        spec.rlcore_kind, spec.rlcore_descriptor = kind, descriptor  # type: ignore[attr-defined]
        spec.rlcore_key, spec.rlcore_rule = key, rule  # type: ignore[attr-defined]
        return hookspec(**options)(spec)
    return mark


def provider(descriptor: type[ProviderSpec], *, key: str | None, rule: str = "") -> Callable:
    """A provider hook whose implementations return ``descriptor`` objects; ``key`` is the config
    key that selects them (a name, or a list of names where the descriptor ``selects`` many), or
    None where core selects by ``rule`` instead (``platform``: by ``engine.device``'s kind). The
    hook, its descriptor, its key and its rule are the hook's row of :data:`ROLES`."""
    return _kind("provider", descriptor, key, rule)


def chain(spec: Callable | None = None, *, firstresult: bool = False) -> Callable:
    """A chain hook, called in the config's plugin order (``firstresult``: the first answer wins)."""
    mark = _kind("chain", firstresult=firstresult)
    return mark if spec is None else mark(spec)


declaration = _kind("declaration")


class RLCoreSpecs:
    """The hook specifications (a namespace; pluggy reads the methods)."""

    # ---------------------------------------------------------------- declarations -------

    @declaration
    def plugin_settings(self) -> PluginSettings | None:
        """Declare this plugin's own config section.

        **Kind:** declaration. **Called:** once, when the plugin is loaded, before the config
        is validated; also by ``rlcore plugins`` and ``rlcore check``.

        :return: a :class:`~rlcore.types.PluginSettings` whose ``section`` is the top-level
            YAML key and whose ``schema`` is a dataclass with defaults, or ``None``. Keys in
            that section that the schema does not define, or values of the wrong type, are
            config errors naming the key. Two plugins claiming one section is an error.

        **Example:**

        .. code-block:: python

            @dataclass
            class FusedSettings:
                block_vocab: int = 4096

            @hookimpl
            def plugin_settings():
                return PluginSettings(section="fused", schema=FusedSettings)
        """

    @declaration
    def constraints(self) -> Iterable[Constraint]:
        """Declare the combinations this plugin cannot work in.

        **Kind:** declaration. **Called:** once per run after the config is resolved, before
        anything is built (``rlcore check`` shows the result).

        :return: :class:`~rlcore.types.IncompatibleWith` (this plugin and another cannot be
            active together) and :class:`~rlcore.types.RequiresCapability` (the provider
            selected for a role must declare a capability) descriptors. A violation fails the
            run with an error that names both distributions and the reason.

        **Example:**

        .. code-block:: python

            @hookimpl
            def constraints():
                yield RequiresCapability(
                    role="rollout_backend", capability=Cap.ROUTED_EXPERTS,
                    reason="R3 replays the experts the rollout engine chose",
                    when=lambda cfg: cfg.replay.mode == "R3")
        """

    # ------------------------------------------------------------------- providers -------

    @provider(ForwardFnSpec, key="forward.name")
    def forward_fn(self) -> Iterable[ForwardFnSpec]:
        """Register policy heads: per-token log-probs and entropy from hidden states.

        **Kind:** provider; selected by ``forward.name``. **Called:** at plugin load (to list
        names); the selected spec's ``factory(ctx: BuildContext)`` is called once per run and
        returns a :class:`~rlcore.types.ForwardFn`.

        The returned callable gets a :class:`~rlcore.types.HeadInput` per micro-batch — final
        hidden states ``[T, H]``, the LM-head rows ``[V_local, H]`` of this tensor-parallel
        rank with their :class:`~rlcore.types.VocabShard` (global offset, real vocab size so
        padding rows are excluded, the TP group), labels, loss mask, temperature (float or
        ``[T]``), sequence-parallel flag — and returns a :class:`~rlcore.types.HeadOutput`
        with fp32 ``logprobs`` and ``entropy`` of shape ``[T]``, differentiable w.r.t.
        hidden and weight, zero at masked positions. Under vocab sharding it combines the
        ranks' softmax statistics itself and leaves the hidden-state gradient reduced.
        Declare :class:`~rlcore.types.Cap` capabilities (``vocab_parallel``,
        ``sequence_parallel``, ``per_token_temperature``, ``entropy``,
        ``mask_skips_compute``); core refuses a config that needs one you lack.

        :return: an iterable of :class:`~rlcore.types.ForwardFnSpec`.

        **Example:**

        .. code-block:: python

            @hookimpl
            def forward_fn():
                def build(ctx):
                    from my_plugin.kernel import MyHead   # heavy import only when selected
                    return MyHead(ctx.settings)
                yield ForwardFnSpec(name="myhead", factory=build,
                                    capabilities={Cap.ENTROPY, Cap.VOCAB_PARALLEL})
        """

    @provider(RolloutBackendSpec, key="rollout.backend")
    def rollout_backend(self) -> Iterable[RolloutBackendSpec]:
        """Register rollout engines that generate samples from the policy.

        **Kind:** provider; selected by ``rollout.backend``. **Called:** at plugin load; the
        selected spec's ``factory(ctx)`` is called once per run and returns a
        :class:`~rlcore.types.RolloutBackend`, which core then ``start``\\ s from an HF-format
        directory the engine wrote.

        The backend returns, per sample, token ids, behaviour log-probs of the processed
        distribution (temperature/top-p applied, as vLLM's ``processed_logprobs``), the weight
        version that produced it and, when asked and able, routed experts. It declares what it
        can do: ``pause``, ``release_kv_cache`` (core frees the KV cache before every weight
        push and restores it after), ``release_weights``, ``prefix_cache_reset``,
        ``routed_experts``, ``speculative``, and which weight-sync receivers it implements
        (``receive_buckets``, ``receive_disk``). ``capabilities()`` on the instance reports
        what really works on this platform (vLLM on CPU cannot sleep); core reports the gap
        and never pretends.

        :return: an iterable of :class:`~rlcore.types.RolloutBackendSpec`.

        **Example:**

        .. code-block:: python

            @hookimpl
            def rollout_backend():
                yield RolloutBackendSpec(
                    name="vllm", factory=lambda ctx: VLLMBackend(ctx.config.rollout),
                    capabilities={Cap.LOGPROBS, Cap.PAUSE, Cap.RELEASE_KV_CACHE})
        """

    @provider(WeightSyncSpec, key="sync.name")
    def weight_sync(self) -> Iterable[WeightSyncSpec]:
        """Register weight transports from the trainer into a rollout backend.

        **Kind:** provider; selected by ``sync.name``. **Called:** at plugin load; the
        selected spec's ``factory(ctx)`` is called once per run and returns a
        :class:`~rlcore.types.WeightSync`.

        ``push(weights, target, version)`` consumes the training engine's export stream of
        ``(hf_name, tensor)`` pairs — full tensors, gathered per tensor across TP/EP ranks —
        typically through :func:`rlcore.sync.iter_buckets` (flattened, dtype-grouped, aligned
        buckets of ``sync.bucket_mb``), moves it into the target, verifies it (checksums of
        what the receiver holds, or probe log-probs) and sets the target's version. Core
        pauses generation and releases the KV cache around the call when the backend can.
        A failed push raises :class:`~rlcore.errors.WeightSyncError` saying which version
        the receiver holds. ``requires_backend`` names the backend capabilities the
        transport needs; ``backends`` restricts it to backends by name.

        :return: an iterable of :class:`~rlcore.types.WeightSyncSpec`.

        **Example:**

        .. code-block:: python

            @hookimpl
            def weight_sync():
                yield WeightSyncSpec(name="vllm-ipc", factory=build_ipc_sync,
                                     capabilities={Cap.BUCKETED, Cap.VERIFIED, Cap.CUDA_IPC},
                                     backends={"vllm"})
        """

    @provider(EngineSpec, key="engine.name")
    def engine(self) -> Iterable[EngineSpec]:
        """Register training engines (built-in ``hf``; ``megatron`` from the ``rlcore-megatron``
        plugin).

        **Kind:** provider; selected by ``engine.name``. **Called:** at plugin load; the
        selected spec's ``factory(ctx)`` is called once per run and returns a
        :class:`~rlcore.types.TrainingEngine`.

        An engine builds the policy (from an HF directory or a tiny config), runs its body
        over a :class:`~rlcore.batch.PackedBatch` to final hidden states (the head is the
        forward_fn's job), consults the ``router_hook`` chain in every MoE router when given
        a dispatcher, records routes when asked, hands out the LM-head weight with its
        :class:`~rlcore.types.VocabShard`, and streams HF-named weights for weight sync.

        :return: an iterable of :class:`~rlcore.types.EngineSpec`.

        **Example:**

        .. code-block:: python

            # rlcore_megatron/plugin.py (distribution rlcore-megatron)
            @hookimpl
            def engine():
                yield EngineSpec(name="megatron", factory=build_megatron_engine,
                                 capabilities={Cap.MOE, Cap.MTP, Cap.TENSOR_PARALLEL})
        """

    @provider(AlgorithmSpec, key="algorithm.name")
    def algorithm(self) -> Iterable[AlgorithmSpec]:
        """Register RL algorithms: an advantage estimator and a policy loss in closed form.

        **Kind:** provider; selected by ``algorithm.name``. **Called:** at plugin load (to
        list names) and when the config is validated (the selected spec's ``settings``
        dataclass becomes part of the ``algorithm:`` section's schema, its ``validate`` runs);
        the selected spec's ``factory(settings)`` is called once per run with the validated
        ``algorithm:`` section and returns a :class:`~rlcore.algorithms.spec.Algorithm`.

        ``Algorithm.advantages(inp: AdvantageInput) -> list[Tensor]`` runs once per step after
        the no-grad passes: per-sample rewards and groups, per-token rewards and rollout
        log-probs in, per-token advantages per sample out. ``Algorithm.loss`` is a
        :class:`~rlcore.algorithms.spec.PolicyLoss`: per token, the policy-gradient term
        ``value(logp, x, seq_log_ratio)`` (differentiable) and ``grad(...)`` → ``(value,
        ∂value/∂logp)`` in closed form, given the token's old and rollout log-probs and
        advantage (:class:`~rlcore.algorithms.spec.TokenInputs`); ``sequence_level`` losses
        (GSPO) also get the sequence's mean log-ratio. Core owns aggregation weights, KL to a
        reference, the entropy bonus and mismatch correction, identical for every algorithm.
        ``rlcore.testing.algorithm_conformance.AlgorithmConformance`` checks a provider.

        :return: an iterable of :class:`~rlcore.algorithms.spec.AlgorithmSpec` (``settings``:
            the algorithm's own keys under ``algorithm:``; ``loss_agg``: its published
            aggregation, used for ``loss_agg: auto``; ``source``: the paper it implements).

        **Example:**

        .. code-block:: python

            @dataclass
            class MySettings:
                clip: float = 0.2

            @hookimpl
            def algorithm():
                def build(settings):
                    from my_plugin.algo import MyAdvantage, MyLoss   # torch only when selected
                    return Algorithm(advantages=MyAdvantage(), loss=MyLoss(settings.clip))
                yield AlgorithmSpec(name="my-po", factory=build, settings=MySettings,
                                    loss_agg="token-mean", source="Me et al. 2026, eq. 3")
        """

    @provider(PlatformSpec, key=None, rule="engine.device's kind (cpu, cuda, npu, ...)")
    def platform(self) -> Iterable[PlatformSpec]:
        """Register device platforms: where tensors live and how ranks talk.

        **Kind:** provider; selected by the device type of ``engine.device`` (``npu`` and
        ``npu:1`` select ``npu``; ``auto`` selects the one available accelerator platform, else
        ``cpu``). Built-in: ``cpu`` (gloo) and ``cuda`` (nccl). **Called:** at plugin load (to
        list names), when the config is resolved (``rlcore check`` shows the platform and
        refuses an unknown device naming the plugin that provides it), and the selected spec's
        ``factory(ctx: BuildContext)`` once per run, before any engine is built, returning the
        activated :class:`~rlcore.types.Platform` (``device(index)``, ``device_count()``,
        ``set_device(index)``, ``synchronize()``, ``dist_backend``).

        The factory is the only place a vendor extension (``torch_npu``) may be imported; when it
        is missing the factory raises :class:`~rlcore.errors.ConfigError` naming the install line.
        ``is_available`` must stay cheap (no vendor import). Engines get the result as
        ``BuildContext.device`` / ``BuildContext.platform``, and :func:`rlcore.platforms.platform_for`
        answers for a ``torch.device`` anywhere (the torch.distributed backend for its ranks).

        :return: an iterable of :class:`~rlcore.types.PlatformSpec` (``device_type``: torch's
            device type; ``dist_backend``; ``is_available``).

        **Example:**

        .. code-block:: python

            @hookimpl
            def platform():
                def activate(ctx):
                    from my_plugin.xpu import XPUPlatform   # imports the vendor extension
                    return XPUPlatform()
                yield PlatformSpec(name="xpu", factory=activate, dist_backend="xccl",
                                   is_available=lambda: importlib.util.find_spec("xpu_ext") is not None)
        """

    @provider(LauncherSpec, key="cluster.backend")
    def launcher(self) -> Iterable[LauncherSpec]:
        """Register launchers: where a run's trainer ranks and rollout replicas run.

        **Kind:** provider; selected by ``cluster.backend``. Built-in: ``local`` (one process;
        every ``cluster.trainer`` size and ``cluster.rollout.replicas`` must be 1); ``ray`` comes
        with rlcore-ray (``plugins: [ray]``). **Called:** at plugin load (to list names); when the
        config is resolved, the selected spec's ``factory(config)`` (cheap: no cluster client
        import) returns a :class:`~rlcore.types.Launcher` whose ``check(stack)`` runs then
        (``rlcore check`` reports its refusals and prints its ``describe(stack)`` line);
        ``rlcore train`` calls its ``train(stack, resume=, overwrite=, allow_config_change=,
        console=)`` once.

        ``check`` decides by the selected providers' capabilities, never by their names: trainer
        ranks of a parallel dimension need an engine that declares it
        (``data_parallel``, ``tensor_parallel``, ``expert_parallel``, ``pipeline_parallel``),
        rollout replicas a backend that declares ``replica``, a fleet of replicas a sync that
        declares ``feeds_replicas``; it raises :class:`~rlcore.errors.ConfigError` naming the key
        and the provider's distribution. ``train`` starts the processes (each rank runs
        :func:`rlcore.parallel.worker.run_rank`) and returns the writer rank's run summary.

        :return: an iterable of :class:`~rlcore.types.LauncherSpec` (``remote_ranks(config)``:
            optional, true when the ranks run on other machines, so this machine's devices are
            not checked for them).

        **Example:**

        .. code-block:: python

            @hookimpl
            def launcher():
                def build(config):
                    from my_plugin.slurm import SlurmLauncher   # cheap: no cluster client yet
                    return SlurmLauncher(config.slurm)
                yield LauncherSpec(name="slurm", factory=build,
                                   remote_ranks=lambda config: True)
        """

    @provider(EnvironmentSpec, key="environment.name")
    def environment(self) -> Iterable[EnvironmentSpec]:
        """Register environments: what answers the model's turns in a rollout (tool outputs, user
        messages, the end of the conversation) and rewards them per turn or at the end.

        **Kind:** provider; selected by ``environment.name``. Built-in: ``single_turn`` (one
        prompt, one completion scored by ``data.reward``: the rollout as it always was) and
        ``tools`` (the model calls the tools ``environment.tools`` names: the ``tool`` hook's;
        docs/agents.md). **Called:** at plugin load (to list
        names); the selected spec's ``factory(ctx: BuildContext)`` once per run, after the
        training engine (``ctx.engine.tokenizer``) and the task (``ctx.extras["task"]``) are
        built, returning an :class:`~rlcore.types.Environment`.

        Core runs the conversation (:mod:`rlcore.environments.conversation`): each turn it
        sends the conversation's exact token ids to ``rollout_backend.generate``, hands the
        turn's generated ids to ``Environment.step(state, turn)`` and inserts the
        :class:`~rlcore.types.EnvStep`'s ``observation_ids`` verbatim (never decoded and
        re-encoded; they are masked out of the loss), until the environment answers ``done`` or
        a limit of ``environment:`` (``max_turns``, ``max_total_tokens``, ``max_tool_calls``)
        ends the sample, the reason recorded in ``Sample.extras["end_reason"]``. ``step`` must
        not raise for anything the model wrote, and a tool it runs must be bounded
        (:mod:`rlcore.environments.tools`). ``rlcore.testing.environment_conformance`` checks a
        provider.

        :return: an iterable of :class:`~rlcore.types.EnvironmentSpec`.

        **Example:**

        .. code-block:: python

            @hookimpl
            def environment():
                def build(ctx):
                    from my_plugin.env import GuessEnvironment   # heavy imports only when selected
                    return GuessEnvironment(ctx.engine.tokenizer, ctx.config.environment)
                yield EnvironmentSpec(name="guess", factory=build,
                                      description="the model guesses; the environment says higher or lower")
        """

    @provider(ToolSpec, key="environment.tools")
    def tool(self) -> Iterable[ToolSpec]:
        """Register tools: what an environment whose spec ``uses_tools`` (built-in ``tools``) lets
        the model call, by name, with one string argument.

        **Kind:** provider that a config selects **many at a time** (``ToolSpec.selects`` is
        ``"many"``): every name in the list ``environment.tools`` (default ``[calc]``), in that
        order. Built-in: ``calc`` (integer arithmetic); ``python`` (code run in a sandbox) comes
        with rlcore-sandbox (docs/agents.md). **Called:** at plugin load (to list names); when the
        config is resolved (``rlcore check`` too), the names are selected, and a name no active
        plugin provides is a config error naming ``environment.tools`` and the plugin that has it;
        once per run, before the environment is built, each selected spec's
        ``factory(ctx: BuildContext)`` (``ctx.settings``: the plugin's own section) returns a
        :class:`~rlcore.environments.tools.Tool`, and the environment's factory gets the list as
        ``ctx.extras["tools"]``. Every call goes through
        :func:`rlcore.environments.tools.call_tool` (bounded by ``environment.tool_timeout_seconds``
        and ``environment.tool_output_chars``; an exception, a hang or garbage is an observation,
        never the run's failure). A factory raises :class:`~rlcore.errors.ConfigError` where its
        tool cannot work here (rlcore-sandbox without bubblewrap).

        :return: an iterable of :class:`~rlcore.types.ToolSpec`.

        **Example:**

        .. code-block:: python

            @hookimpl
            def tool():
                def build(ctx):
                    from my_plugin.search import search       # heavy imports only when selected
                    return Tool("search", lambda query: search(query, ctx.settings.index),
                                "searches the index; answers with the top hit")
                yield ToolSpec(name="search", factory=build, description="searches an index")
        """

    @provider(TrackerSpec, key="tracking.backends")
    def tracker(self) -> Iterable[TrackerSpec]:
        """Register experiment trackers: where each step's metrics go besides ``metrics.jsonl``.

        **Kind:** provider that a config selects **many at a time** (``TrackerSpec.selects`` is
        ``"many"``): every name in the list ``tracking.backends`` runs, in that order, plus
        ``tensorboard`` while ``output.tensorboard`` is true and its package is installed.
        Built-in: ``tensorboard``, ``mlflow``, ``wandb``, ``trackio`` (docs/tracking.md).
        **Called:** at plugin load (to list names); when the config is resolved (``rlcore check``
        too), each selected spec's ``requires`` are looked up without importing them, and a missing
        one is a :class:`~rlcore.errors.ConfigError` naming the spec's ``install`` line; on the
        writer rank, once per run before the first step, each selected spec's
        ``factory(run_dir, config, versions)`` returns a :class:`~rlcore.types.Tracker`, whose
        ``log(step, metrics)`` core calls after every step with the step's finite numeric metrics
        (as written to ``metrics.jsonl``) and whose ``close()`` it calls at the end of the run.

        The factory imports the tracker's package (only then: a tracker that is not selected costs
        nothing), starts a run and logs the resolved config, the versions (``versions``: Python,
        rlcore, torch, transformers, every active plugin) and the run directory. Its settings are
        its own: the built-ins read ``tracking.<name>``, a plugin's tracker reads its plugin's
        section. A tracker that raises, at start or in a call, is warned about once
        (:class:`rlcore.tracking.TrackerWarning` naming it and the error) and not called again:
        the run goes on and ``metrics.jsonl`` stays complete.

        :return: an iterable of :class:`~rlcore.types.TrackerSpec` (``requires``: the modules the
            factory imports; ``install``: the pip line that brings them).

        **Example:**

        .. code-block:: python

            @hookimpl
            def tracker():
                def start(run_dir, config, versions):
                    from my_plugin.aim_tracker import AimTracker   # the package, only when selected
                    return AimTracker(run_dir, config, versions)
                yield TrackerSpec(name="aim", factory=start, requires=("aim",),
                                  install="pip install aim")
        """

    # ---------------------------------------------------------------------- chains -------

    @chain
    def forward_request(self, ctx: MicroBatchContext) -> ForwardRequest | None:
        """Ask for extra outputs from the next micro-batch forward.

        **Kind:** chain (all answers are merged: any True wins). **Called:** before every
        micro-batch forward of every phase.

        :param ctx: the micro-batch about to run (step, phase, index, the packed batch).
        :return: a :class:`~rlcore.types.ForwardRequest` (``record_routes``: the engine
            records the experts every router chose into ``EngineOutput.routes``;
            ``mtp_hidden``: the engine returns MTP hidden states; ``native_logprobs``: core
            runs the micro-batch once more with native routing, no router_hook chain and no
            gradient, and hands its log-probs to postprocess as
            ``ModelOutput.native_logprobs``), or ``None``.

        **Example:**

        .. code-block:: python

            @hookimpl
            def forward_request(ctx):
                if ctx.phase == "old_logprob":       # R2 records during the log-prob pass
                    return ForwardRequest(record_routes=True)
        """

    @chain
    def postprocess(self, ctx: MicroBatchContext, output: ModelOutput) -> PostprocessResult | None:
        """Add loss terms and metrics after a micro-batch forward, or collect its outputs.

        **Kind:** chain, in ``plugins:`` order; every result is used. **Called:** after the
        head ran on each micro-batch, in every phase (``old_logprob``, ``ref_logprob``,
        ``train``), before the policy loss is formed.

        :param ctx: the micro-batch (phase, index, the packed batch with its fields).
        :param output: the engine output (hidden states, MTP hidden states, recorded routes),
            the head output (log-probs, entropy), the head weight and the selected forward_fn
            — so an MTP loss uses the same (possibly fused) head as the policy loss.
        :return: a :class:`~rlcore.types.PostprocessResult` (``loss_terms`` added to the
            loss in ``train``; ``metrics`` logged; ``batch_updates`` written back into the
            step's batch, e.g. routes recorded for R2), or ``None``.

        **Example:**

        .. code-block:: python

            @hookimpl
            def postprocess(ctx, output):
                if ctx.phase != "train" or output.engine.mtp_hidden is None:
                    return None
                loss = mtp_loss(output.forward_fn, output.engine.mtp_hidden,
                                output.head_weight, ctx.batch)
                return PostprocessResult(loss_terms={"mtp": 0.1 * loss},
                                         metrics={"mtp_loss": float(loss)})
        """

    @chain(firstresult=True)
    def router_hook(self, call: RouterCall) -> RouterDecision | None:
        """Choose the experts of an MoE router (routing replay), or let it route natively.

        **Kind:** chain, in ``plugins:`` order; **the first non-None answer wins** and the
        rest are not called. **Called:** by the training engine for every MoE router
        (decoder layers and MTP layers) on every forward, and again during activation
        recomputation (``call.recompute``: answer as in the forward), when an active plugin
        implements it. Every engine asks inside the router, after its scores (megatron-core ≥
        0.16 through its native ``RouterReplay``, earlier versions by interception), so
        ``call.scores`` is set.

        :param call: which router (``layer`` id and ``routed_index`` in
            :class:`~rlcore.types.RouteLayout` order, ``is_mtp``), which tokens of the
            micro-batch it sees (``token_offset``, ``num_tokens``), the micro-batch context
            (whose batch carries the rollout's routes for R3: ``batch.routes()`` decodes the
            compact ``routes`` / ``routes_native`` fields), and the router scores when available.
        :return: a :class:`~rlcore.types.RouterDecision` with ``[num_tokens, topk]`` integer
            expert indices to use (probabilities are recomputed from the router's own scores, so
            the router still gets gradients; negative rows route natively), or ``None``. Every
            engine checks the answer the same way (:func:`rlcore.engines.routing.apply_router_decision`):
            a wrong shape or dtype, an expert outside ``[0, num_experts)`` or one expert twice
            in a row raises :class:`~rlcore.errors.BatchShapeError` naming the layer.

        **Example:**

        .. code-block:: python

            @hookimpl
            def router_hook(call):
                routes = call.micro_batch.batch.routes()   # int64, -1 = route natively
                if routes is None or call.is_mtp:
                    return None
                rows = routes[call.token_offset: call.token_offset + call.num_tokens]
                return RouterDecision(indices=rows[:, call.routed_index].long())
        """

    @chain
    def step_end(self, ctx: StepContext) -> dict[str, float] | None:
        """Merge per-step state and report step-level metrics.

        **Kind:** chain, in ``plugins:`` order. **Called:** once per training step, after
        the optimizer step and before the weight push.

        :param ctx: the step number, the step's packed batch and the metrics so far.
        :return: extra metrics (logged under their names), or ``None``.

        **Example:**

        .. code-block:: python

            @hookimpl
            def step_end(ctx):
                return {"replay/coverage": replayed_tokens / ctx.batch.num_tokens}
        """


def _hooks(kind: str) -> tuple[str, ...]:
    return tuple(name for name, spec in vars(RLCoreSpecs).items() if getattr(spec, "rlcore_kind", None) == kind)


PROVIDER_HOOKS = _hooks("provider")
CHAIN_HOOKS = _hooks("chain")
DECLARATION_HOOKS = _hooks("declaration")
ALL_HOOKS = PROVIDER_HOOKS + CHAIN_HOOKS + DECLARATION_HOOKS


@dataclass(frozen=True)
class Role:
    """One provider hook's row of the role table: the hook (also the :class:`rlcore.stack.Stack`
    field that holds the selection), the descriptor type its implementations return, the config
    key that selects (``None``: core selects by another rule) and whether it selects one provider
    or many (the descriptor class says it)."""

    hook: str
    descriptor: type[ProviderSpec]
    key: str | None
    #: how core selects where ``key`` is None
    rule: str = ""

    @property
    def selected_by(self) -> str:
        return self.key or self.rule

    @property
    def selects(self) -> str:
        return self.descriptor.selects


#: the role table, read from the ``@provider`` decorators above: the manager's typed lookups,
#: ``rlcore.stack.resolve``'s selections, ``Stack.role``, ``rlcore plugins`` and docs/hooks.md's
#: role table (a test compares them) all read it
ROLES: dict[str, Role] = {
    name: Role(name, spec.rlcore_descriptor, spec.rlcore_key, spec.rlcore_rule)
    for name, spec in ((name, getattr(RLCoreSpecs, name)) for name in PROVIDER_HOOKS)
}
#: the descriptor type each provider hook's implementations return
DESCRIPTORS: dict[str, type[ProviderSpec]] = {name: role.descriptor for name, role in ROLES.items()}
