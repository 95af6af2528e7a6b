"""A step's samples packed into the one :class:`~rlcore.batch.PackedBatch` that carries the step
from rollout to loss: token ids, the rollout's behaviour log-probs, rewards and groups, and the
routed experts a rollout engine returned (stored compactly). A multi-turn sample's observations
(``Sample.response_mask`` false) are in the sequence, as the model saw them, but not in the loss
mask: the aggregation, KL, entropy and token metrics, which all follow the loss mask, skip them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcore.batch import ROUTES_NATIVE, PackedBatch, compact_routes, sample_routes
from rlcore.types import Sample


def pack_samples(samples: Sequence[Sample], rewards: Sequence[float], engine: Any, step: int) -> PackedBatch:
    """Pack ``samples`` (scored ``rewards``) for ``engine`` (its pad id, route layout and sequence
    alignment); ``step`` names the step in errors."""
    seqs = [list(s.prompt_ids) + s.response_ids.tolist() for s in samples]
    starts = [len(s.prompt_ids) for s in samples]
    target = {"old_logprobs": [s.logprobs.float() for s in samples]}
    inputs = {}
    seq_fields = {"reward": torch.tensor(list(rewards)), "group": torch.tensor([s.prompt_index for s in samples])}
    layout = engine.info.route_layout
    have = [s.routed_experts is not None for s in samples]
    if layout is not None and any(have):
        # samples the rollout engine returned no routes for keep -1 rows (route natively) and
        # are marked in ``routes_present``: never dropped in silence (a replay plugin decides)
        inputs["routes"] = [
            sample_routes(s.routed_experts, layout, len(seq), f"step {step} sample {i}") if ok
            else torch.full((len(seq) - 1, layout.num_routed, layout.topk), -1, dtype=torch.int16)
            for i, (s, seq, ok) in enumerate(zip(samples, seqs, have, strict=True))]
        seq_fields["routes_present"] = torch.tensor(have)
    batch = PackedBatch.pack(
        seqs, starts, target_fields=target, input_fields=inputs, seq_fields=seq_fields,
        align=int(getattr(engine, "sequence_alignment", 1)),
        pad_id=engine.info.pad_token_id,
        response_masks=[s.response_mask for s in samples],
    )
    if "routes" in batch.fields:
        # stored compactly from here on (uint8 ids up to 256 experts, int16 beyond, and a
        # [T, layers] native mask); read them with batch.routes()
        batch.fields["routes"], batch.fields[ROUTES_NATIVE] = compact_routes(batch.fields["routes"],
                                                                             layout.num_experts)
    return batch
