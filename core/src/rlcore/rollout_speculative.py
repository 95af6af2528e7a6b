"""Speculative sampling for the ``local`` rollout, with the model's own MTP layers as the draft.

``rollout.draft_depths: D`` (D >= 1) makes the local rollout draft ``D`` tokens with MTP depths
``1..D`` (:mod:`rlcore.engines.mimo`), verify them with one target forward of ``D + 1``
positions, and keep what standard speculative sampling keeps (Leviathan et al. 2023, Chen et al.
2023): draft ``y_i ~ q_i`` is accepted with probability ``min(1, p_i(y_i) / q_i(y_i))``; at the
first rejection the token is drawn from the normalised residual ``max(0, p_i - q_i)``; when every
draft is accepted a bonus token is drawn from ``p_{D+1}``. ``p`` and ``q`` are both the processed
distributions (temperature, top-k, top-p), so every emitted token is distributed exactly as
non-speculative sampling from the target, and its log-prob is the target's. Greedy
(temperature 0) accepts a draft iff it is the target's argmax.

Draft depth ``k`` at the last verified position ``a`` reads the target's pre-norm hidden state
(depth 1) or depth ``k - 1``'s output, and the embedding of token ``a + k`` — the last emitted
token for depth 1, then the drafts — exactly the training semantics of
:mod:`rlcore.engines.mimo_layout`. The target keeps a KV cache (cropped to the accepted
prefix); the MTP layers are recomputed over the sequence for each draft (tiny models).

Acceptance per depth follows vLLM's ``num_accepted_tokens_per_pos / num_drafts``: the fraction
of draft rounds in which depth ``k``'s token was accepted (so it can only fall with ``k``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.engines.kv_cache import cache_arg


@dataclass
class DraftStats:
    """Counts over one ``generate`` call: draft rounds per depth and accepted drafts per depth."""

    rounds: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, depth_rounds: int, accepted: int) -> None:
        """One round that drafted ``depth_rounds`` tokens and accepted the first ``accepted``."""
        while len(self.rounds) < depth_rounds:
            self.rounds.append(0)
            self.accepted.append(0)
        for k in range(depth_rounds):
            self.rounds[k] += 1
            if k < accepted:
                self.accepted[k] += 1

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/acceptance_d{k + 1}": a / r for k, (r, a) in enumerate(zip(self.rounds, self.accepted,
                                                                                     strict=True)) if r}
        total = sum(self.rounds[:1])
        if total:
            out["rollout/accept_length"] = 1.0 + sum(self.accepted) / total  # tokens per target forward
        return out


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, gen: torch.Generator,
                  greedy: bool) -> tuple[list[int], int]:
    """Speculative-sampling acceptance for one round.

    ``p``: ``[d + 1, V]`` target probabilities at the ``d + 1`` verified positions; ``q``:
    ``[d, V]`` draft probabilities; ``drafts``: ``[d]`` the drafted tokens (``drafts[i] ~ q[i]``).
    Returns the emitted tokens (the accepted drafts, then one token from the residual or, when
    all were accepted, from ``p[d]``) and the number of accepted drafts."""
    d = int(drafts.shape[0])
    out: list[int] = []
    for i in range(d):
        y = int(drafts[i])
        if greedy:
            ok = y == int(p[i].argmax())
        else:
            u = torch.rand((), generator=gen, device=p.device)
            ok = bool(u * q[i, y] < p[i, y])  # u < p/q without dividing (q[y] > 0: y was drawn from q)
        if not ok:
            if greedy:
                out.append(int(p[i].argmax()))
            else:
                residual = (p[i] - q[i]).clamp(min=0)
                dist = residual if float(residual.sum()) > 0 else p[i]
                out.append(int(torch.multinomial(dist / dist.sum(), 1, generator=gen)))
            return out, i
        out.append(y)
    last = int(p[d].argmax()) if greedy else int(torch.multinomial(p[d], 1, generator=gen))
    out.append(last)
    return out, d


@torch.no_grad()
def generate_one(model: Any, prompt: list[int], params: Any, depths: int, gen: torch.Generator,
                 stop: set[int], stats: DraftStats, process_logits: Any) -> tuple[list[int], list[float], bool, int]:
    """Sample one sequence speculatively. Returns (tokens, target log-probs, stopped, peak KV
    cache bytes)."""
    dev = next(model.parameters()).device
    greedy = params.temperature <= 0

    def processed(logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, params.temperature, params.top_k, params.top_p)

    cache = cache_arg(model.forward)  # 'cache' in transformers 5 (the old name warns on every call)

    def target(ids: list[int], start: int, past: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        pos = torch.arange(start, start + len(ids), device=dev)[None]
        with model.trunk_prenorm_hidden() as trunk:
            out = model(input_ids=x, position_ids=pos, use_cache=True, **{cache: past})
        return processed(out.logits[0]), trunk.value[0], getattr(out, cache)

    def sample(lp: torch.Tensor) -> int:
        return int(lp.argmax()) if greedy else int(torch.multinomial(lp.exp(), 1, generator=gen))

    lp, hidden, past = target(list(prompt), 0, None)
    seq = list(prompt)
    prenorm = [hidden]  # the trunk's pre-norm hidden state of every position the cache holds
    tok = sample(lp[-1])
    tokens, logps = [tok], [float(lp[-1, tok])]
    seq.append(tok)
    peak = 0
    while tok not in stop and len(tokens) < params.max_new_tokens:
        d = min(depths, params.max_new_tokens - len(tokens))  # a bonus token past the limit is dropped
        drafts, q_rows = [], []
        trunk = torch.cat(prenorm, 0)  # [len(seq) - 1, H]
        for k in range(1, d + 1):
            ids = torch.tensor([seq + drafts], dtype=torch.long, device=dev)
            padded = torch.cat([trunk, trunk.new_zeros(ids.shape[1] - trunk.shape[0], trunk.shape[1])])[None]
            h = model.mtp_forward(ids, torch.ones_like(ids), padded, depths=k)[k - 1][0, trunk.shape[0] - 1]
            q_lp = processed(model.lm_head(h)[None])[0]
            drafts.append(sample(q_lp))
            q_rows.append(q_lp.exp())
        lp, hidden, past = target([seq[-1], *drafts], len(seq) - 1, past)
        peak = max(peak, sum(t.numel() * t.element_size() for layer in past.layers
                             for t in (layer.keys, layer.values) if t is not None))
        q = torch.stack(q_rows) if q_rows else lp.new_zeros(0, lp.shape[1])
        emitted, accepted = accept_drafts(lp.exp(), q, torch.tensor(drafts, dtype=torch.long), gen, greedy)
        if d:
            stats.add(d, accepted)
        past.crop(-(d - accepted))  # keep the last token and the accepted drafts
        prenorm.append(hidden[: accepted + 1])
        for i, t in enumerate(emitted):
            tokens.append(t)
            logps.append(float(lp[i, t]))
            seq.append(t)
            tok = t
            if t in stop or len(tokens) >= params.max_new_tokens:
                break
    return tokens, logps, tok in stop, peak
