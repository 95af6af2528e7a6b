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
  has no route (padding, the last token of a sequence), as samples and engines hand them over.
  ``routed_layers`` follows :class:`RouteLayout`: decoder MoE layers in ascending layer index,
  then MTP layers. In a :class:`~rlcore.batch.PackedBatch` they are stored compactly: field
  ``routes`` holds uint8 ids up to 256 experts (int16 up to 32768) and ``routes_native``
  ``[tokens, routed_layers]`` says which rows route natively; read them with
  ``batch.routes()`` (int64, ``-1`` restored).
* **Vocab sharding.** The LM-head weight a forward_fn receives may be this rank's rows of a
  vocab-parallel weight; :class:`VocabShard` says which global ids it holds and which of them
  are padding.
"""

# One import surface for plugins (``from rlcore.types import X``); the definitions live in the
# submodules, one per side of the contract.
from rlcore.types.algorithms import (
    LOSS_AGGREGATIONS,
    AdvantageEstimator,
    AdvantageInput,
    Algorithm,
    AlgorithmSpec,
    PolicyLoss,
    TokenInputs,
    TokenLoss,
)
from rlcore.types.chains import ForwardRequest, ModelOutput, PostprocessResult, StepContext
from rlcore.types.environment import Environment, EnvironmentSpec, EnvStep, ToolCall, ToolSpec, Turn
from rlcore.types.forward import (
    EngineOutput,
    ForwardFn,
    HeadInput,
    HeadOutput,
    HeadWeight,
    LossRequest,
    MicroBatchContext,
    ModelInfo,
    Phase,
    RouteLayout,
    RouterCall,
    RouterDecision,
    RouterDispatch,
    TrainingEngine,
    VocabShard,
)
from rlcore.types.providers import (
    PLUGIN_API,
    BuildContext,
    Cap,
    Constraint,
    EngineSpec,
    ForwardFnSpec,
    IncompatibleWith,
    Launcher,
    LauncherSpec,
    Platform,
    PlatformSpec,
    PluginSettings,
    ProviderSpec,
    RequiresCapability,
    RolloutBackendSpec,
    Tracker,
    TrackerSpec,
    WeightSyncSpec,
    normalise_name,
)
from rlcore.types.rollout import (
    BucketReceiver,
    DiskReceiver,
    MemoryTag,
    Prompt,
    RolloutBackend,
    Sample,
    SamplingSettings,
    SyncReport,
    WeightSync,
    implements,
)
from rlcore.types.value import ValueModel, value_head

__all__ = [
    # providers
    "PLUGIN_API", "normalise_name", "Cap", "ProviderSpec", "ForwardFnSpec", "RolloutBackendSpec",
    "WeightSyncSpec", "EngineSpec", "PluginSettings", "IncompatibleWith", "RequiresCapability",
    "Constraint", "BuildContext", "PlatformSpec", "Platform", "LauncherSpec", "Launcher", "TrackerSpec", "Tracker",
    # forward
    "VocabShard", "HeadInput", "HeadOutput", "LossRequest", "ForwardFn", "RouteLayout", "ModelInfo", "RouterCall",
    "RouterDecision", "EngineOutput", "HeadWeight", "TrainingEngine", "RouterDispatch", "Phase",
    "MicroBatchContext",
    # chains
    "ForwardRequest", "ModelOutput", "PostprocessResult", "StepContext",
    # rollout and weight sync
    "SamplingSettings", "Prompt", "Sample", "MemoryTag", "RolloutBackend", "BucketReceiver", "implements",
    "DiskReceiver", "SyncReport", "WeightSync",
    # environments (docs/agents.md)
    "EnvironmentSpec", "Environment", "Turn", "EnvStep", "ToolCall", "ToolSpec",
    # algorithms (docs/algorithms.md)
    "AlgorithmSpec", "Algorithm", "AdvantageInput", "AdvantageEstimator", "TokenInputs", "PolicyLoss", "TokenLoss",
    "LOSS_AGGREGATIONS",
    # the critic (Cap.VALUE_MODEL)
    "ValueModel", "value_head",
]
