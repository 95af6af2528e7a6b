"""The ``megatron:`` config section and the engine's declared capabilities (importing this
module imports no engine)."""

from dataclasses import dataclass

from rlcore.types import Cap

#: what the ``megatron`` engine declares (its EngineSpec) and what the engine object reports
ENGINE_CAPABILITIES = frozenset(
    {Cap.MOE, Cap.MTP, Cap.ROUTER_HOOK, Cap.RECORD_ROUTES, Cap.TENSOR_PARALLEL, Cap.EXPERT_PARALLEL}
)


@dataclass
class MegatronSettings:
    """``megatron:`` section.

    * ``tensor_parallel_size`` / ``expert_parallel_size``: model split over ranks (launch with
      ``torchrun --nproc-per-node N``; every rank runs the same step). ``pipeline_parallel_size``
      must be 1 (pipelining needs the loss inside megatron's schedule).
    * ``sequence_parallel``: only with Transformer Engine (the THD path).
    * ``attention``: ``auto`` (THD with Transformer Engine on CUDA, else padded rows), ``te``, ``local``.
    * ``token_dispatcher``: ``allgather`` (any device) or ``alltoall`` (CUDA).
    * ``moe_aux_loss_coeff``: megatron's load-balancing loss (0: off, the RL default).
    * ``vocab_size_divisible_by``: the embedding and LM head are padded to a multiple of this ×
      TP; padding rows are excluded from the softmax and never exported.
    * ``export_mtp``: include MTP layers in the weights sent to the rollout engine (a rollout
      engine that serves MTP drafts needs them; the built-in local rollout has no MTP).
    * ``seed``: megatron's model-parallel CUDA RNG seed.
    """

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False
    attention: str = "auto"
    token_dispatcher: str = "allgather"
    moe_aux_loss_coeff: float = 0.0
    vocab_size_divisible_by: int = 128
    export_mtp: bool = True
    seed: int = 1234
