"""What one micro-batch forward takes and gives.

The policy head (``forward_fn``: :class:`HeadInput` → :class:`HeadOutput` over a
:class:`VocabShard`), the training engine's body (:class:`TrainingEngine` →
:class:`EngineOutput`), the MoE router seam (:class:`RouteLayout`, :class:`RouterCall`,
:class:`RouterDecision`) and where a forward stands (:class:`MicroBatchContext`). Import these
from :mod:`rlcore.types`; the conventions (token axis, label alignment, routes, vocab sharding)
are in its docstring.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch

    from rlcore.batch import PackedBatch


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
    * ``compute_sum_pi_squared``: whether :attr:`HeadOutput.sum_pi_squared` is needed (only a
      head that declares ``Cap.SUM_PI_SQUARED`` is asked: core asks in the ``old_logprob``
      pass of an algorithm that needs it, e.g. ``optimal_token_baseline``).
    * ``loss``: train phase only, and only for a head that declares ``Cap.FUSED_LOSS``: the
      micro-batch's per-token objective (:class:`LossRequest`). The head may compute the loss
      itself (:attr:`HeadOutput.loss`) or decline (leave it ``None`` and return differentiable
      log-probs as usual); core then forms the loss from the log-probs.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    vocab: VocabShard
    loss_mask: torch.Tensor | None = None
    temperature: float | torch.Tensor = 1.0
    sequence_parallel: bool = False
    compute_entropy: bool = True
    loss: LossRequest | None = None
    compute_sum_pi_squared: bool = False


@dataclass
class LossRequest:
    """The per-token loss contract a ``Cap.FUSED_LOSS`` head receives in the train phase.

    * ``objective``: the step's :class:`rlcore.algorithms.losses.TokenObjective`; its
      ``closed_form(logprobs, entropy, inputs)`` gives each token's loss value and
      ``∂/∂logp``, ``∂/∂H`` (elementwise, so a head may evaluate it on any subset of tokens,
      e.g. a chunk, with :meth:`inputs_at`).
    * ``inputs``: :class:`rlcore.algorithms.spec.TokenInputs` over the micro-batch's token axis
      (old/rollout log-probs, advantages, mask, aggregation weights ``w_t``, correction
      weights, reference log-probs).

    * ``complete``: ``None``, or (``algorithm.old_logprobs: current``) a function
      ``(inputs, logprobs) -> inputs`` that a head calls through :meth:`inputs_for` on every
      subset it evaluates: the ratio's denominator is then the head's own log-probs (detached)
      and the correction weights are computed from them, so ``inputs.old_logprobs`` is NaN and
      ``inputs.correction`` unset until it is called.

    Core sends it only for token-level losses (``objective.loss.sequence_level`` False): a
    sequence-level loss (GSPO) needs every log-prob of a sequence before any derivative.
    """

    objective: Any
    inputs: Any
    complete: Any = None

    def inputs_for(self, inputs: Any, logprobs: torch.Tensor):
        """``inputs`` (:attr:`inputs` or a subset of it, e.g. from :meth:`inputs_at`) ready for
        ``objective.closed_form`` at these tokens' ``logprobs``: unchanged unless
        :attr:`complete` is set."""
        return inputs if self.complete is None else self.complete(inputs, logprobs)

    def inputs_at(self, index: torch.Tensor):
        """``inputs`` restricted to the tokens ``index`` (a ``[n]`` long tensor): what
        ``objective.closed_form`` takes for those tokens' log-probs and entropy."""
        from dataclasses import replace

        x = self.inputs

        def pick(t):
            return None if t is None else t.index_select(0, index.to(t.device))

        return replace(x, old_logprobs=pick(x.old_logprobs), rollout_logprobs=pick(x.rollout_logprobs),
                       advantages=pick(x.advantages), mask=pick(x.mask), weights=pick(x.weights),
                       correction=pick(x.correction), ref_logprobs=pick(x.ref_logprobs),
                       seq_index=pick(x.seq_index))


@dataclass
class HeadOutput:
    """``logprobs`` and ``entropy`` are ``[T]`` float32 (full T, also under sequence
    parallelism), 0 at masked positions, differentiable w.r.t. hidden and weight.

    ``loss`` is set only by a ``Cap.FUSED_LOSS`` head that took :attr:`HeadInput.loss`: the
    0-d micro-batch loss ``Σ_t value_t`` of ``objective.closed_form``, whose backward delivers
    the hidden-state and weight gradients (already formed in the forward, scaled by the
    incoming gradient). ``logprobs`` and ``entropy`` are then detached (metrics, postprocess
    chains); a postprocess loss term that needs differentiable log-probs recomputes them
    through ``ModelOutput.forward_fn`` without ``loss``.

    ``sum_pi_squared``, when :attr:`HeadInput.compute_sum_pi_squared` asks for it: ``[T]``
    float32, per token ``Σ_v π(v)²`` of the whole temperature-scaled softmax (padding rows
    excluded, every tensor-parallel rank's rows included), 0 at masked positions, without
    gradient. Heads form it as ``Σ e^{2(z−m)} / (Σ e^{z−m})²`` with ``m`` the global max
    logit: nothing overflows and no ``[T, V]`` probabilities are kept."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None


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

    @property
    def mtp_depths(self) -> int:
        """MTP routers on the routed-layer axis (layers ``>= num_hidden_layers``)."""
        return sum(1 for layer in self.layers if layer >= self.num_hidden_layers)

    def select(self, routes_all_layers: torch.Tensor) -> torch.Tensor:
        """``[N, L, K]`` → ``[N, len(layers), K]`` in layout order.

        ``L`` must be exactly one of: ``num_routed`` (already in layout order),
        ``num_hidden_layers`` (a rollout engine's report of every decoder layer, dense ones
        included; MTP columns it lacks are filled with -1, route natively) or
        ``num_hidden_layers + mtp_depths`` (decoder and MTP layers). Any other count is an error
        naming both counts: routes of a wider or narrower model are never cut to a subset."""
        if routes_all_layers.dim() != 3 or routes_all_layers.shape[2] != self.topk:
            raise ValueError(
                f"routes must be [tokens, layers, topk={self.topk}], got {tuple(routes_all_layers.shape)}"
            )
        have = int(routes_all_layers.shape[1])
        if have == self.num_routed:
            return routes_all_layers
        full = self.num_hidden_layers + self.mtp_depths
        if have not in (self.num_hidden_layers, full):
            mtp = f" + {self.mtp_depths} MTP" if self.mtp_depths else ""
            raise ValueError(
                f"routes have {have} layers; the model has {self.num_hidden_layers} decoder layers{mtp} "
                f"({self.num_routed} routed: layers {list(self.layers)}), so routes must have "
                f"{sorted({self.num_routed, self.num_hidden_layers, full})} layers: routes of another model "
                f"are not cut to fit"
            )
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
    pre-top-k scores ``[num_tokens, num_experts]`` (every engine consults the chain inside the
    router, after the scores: megatron-core's native ``RouterReplay`` path too), or ``None``
    only from an engine that cannot provide them. ``recompute`` is True when the router runs
    again under activation recomputation in backward: the answer must be the one given in the
    forward (engines check that the experts are identical and raise naming the layer)."""

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
    after the final norm. ``mtp_hidden``: one ``[T, H]`` per MTP depth, in packed order
    (``mtp_hidden[d - 1]`` is depth ``d``, which predicts token ``t + 1 + d`` of the same
    sequence), ready for the LM head, or None. ``routes``: the experts every router chose, ``[T, routed_layers,
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
    """Runs the policy body on packed batches, owns its parameters and exports HF weights.
    Optional: ``close()``, which the trainer calls once when its run ends (success or error), for
    an engine that initialised process-wide state to release it (megatron's parallel state and
    the process groups it created itself)."""

    info: ModelInfo

    def forward(
        self,
        batch: PackedBatch,
        *,
        record_routes: bool = False,
        router: RouterDispatch | None = None,
        micro_batch: MicroBatchContext | None = None,
        mtp_hidden: bool = False,
        mtp_detach_trunk: bool = False,
    ) -> EngineOutput:
        """Body forward of one micro-batch to final hidden states. ``record_routes``: fill
        ``EngineOutput.routes``; ``router``: consult it in every MoE router; ``mtp_hidden``:
        also return MTP hidden states (engines with MTP layers); ``mtp_detach_trunk`` (passed only
        with ``mtp_hidden=True``): detach the MTP layers' inputs from the trunk (its hidden state
        and the shared embedding lookups)."""
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
