"""Behaviour log-probs at the temperature the trainer recomputes them with.

The trainer recomputes every sampled token's log-prob under ``softmax(logits / T)`` with
``T = rollout.temperature``. vLLM returns that distribution's log-probs only when it samples at
``T`` in ``processed_logprobs`` mode. Two cases where it does not:

* a temperature below ``GREEDY_BELOW`` is sent as 0 (greedy); vLLM then returns the unscaled
  distribution's log-probs (temperature 1);
* with speculative decoding on vLLM's CPU build the engine runs in ``raw_logprobs`` mode (its
  processed ones are broken there), i.e. temperature 1 whatever it sampled at.

In both, vLLM's log-probs are ``log_softmax(logits)`` up to nothing, so the ones at ``T`` follow
from them: ``log p_T(c) = r_c / T - log Σ_j exp(r_j / T)``. The backend asks vLLM for the top
``K`` log-probs of every position (plus the sampled one's) and computes that sum over them; the
tokens not returned each have ``r_j`` below every returned top-K one, which bounds the error. On main the MTP
example's behaviour log-probs were those of temperature 1 against the trainer's 1e-6: off by
more than 1 nat on average, every token clipped.
"""

from __future__ import annotations

import math
from typing import Any

#: log-probs vLLM returns per position for the recomputation (vLLM's default ``max_logprobs``)
TOP_LOGPROBS = 20
#: the largest error (nats) allowed for a recomputed log-prob from the tokens vLLM did not return
TEMPERED_ERROR_BOUND = 1e-4


def tempered_logprob(chosen: int, entries: dict[int, float], temperature: float, vocab_size: int) -> tuple[float, float]:
    """``(log p_T(chosen), error bound)`` from temperature-1 log-probs ``entries`` (``chosen``
    among them) of a ``vocab_size`` distribution: the true value lies within ``[value - bound, value]``."""
    base = entries[chosen]
    scaled = [(r - base) / temperature for r in entries.values()]
    top = max(scaled)
    lse = top + math.log(sum(math.exp(x - top) for x in scaled))  # log Σ_returned exp((r_j - r_c) / T)
    missing = vocab_size - len(entries)
    bound = 0.0
    if missing > 0:
        # a token not returned is below every returned top-K token; the sampled one may be an extra
        # below them (vLLM returns it besides the top K), so it does not bound the rest
        others = [r for t, r in entries.items() if t != chosen]
        if not others:
            return -lse, math.inf
        log_tail = math.log(missing) + (min(others) - base) / temperature - lse
        bound = log_tail if log_tail > 30 else math.log1p(math.exp(log_tail))
    return -lse, bound


def needs_tempering(temperature: float, sent_temperature: float, raw_logprobs: bool) -> bool:
    """Whether vLLM's returned log-probs are not already those of ``softmax(logits / temperature)``."""
    if temperature <= 0:
        return False
    return sent_temperature != temperature or (raw_logprobs and temperature != 1.0)


def sampled_logprobs(container: Any, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token from a completion's ``logprobs``: vLLM's flat container
    (``SamplingParams(flat_logprobs=True)``: columns ``start_indices``, ``end_indices``,
    ``token_ids``, ``logprobs``, read once each, no Python object per position) or the list of
    ``{token id: Logprob}`` dicts. vLLM puts the sampled token first at every position; a
    position where it is not first is searched (a container that lacks the token raises
    ``KeyError``, as the dict form does)."""
    if container is None:
        return []
    starts = getattr(container, "start_indices", None)
    if starts is None:  # one {token id: Logprob} dict per position
        return [float(entry[tok].logprob) for tok, entry in zip(token_ids, container, strict=False)]
    starts, ends = list(starts), list(container.end_indices)
    flat_ids, flat_lps = list(container.token_ids), list(container.logprobs)
    n = min(len(token_ids), len(starts))
    out = [float(flat_lps[starts[i]]) if ends[i] > starts[i] and flat_ids[starts[i]] == token_ids[i] else None
           for i in range(n)]
    for i, value in enumerate(out):
        if value is None:  # not first: look through the position's entries
            found = [flat_lps[j] for j in range(starts[i], ends[i]) if flat_ids[j] == token_ids[i]]
            if not found:
                raise KeyError(token_ids[i])
            out[i] = float(found[0])
    return out  # type: ignore[return-value]


def supports_flat_logprobs() -> bool:
    """Whether this vLLM's ``SamplingParams`` has ``flat_logprobs`` (a msgspec struct's field)."""
    from vllm import SamplingParams

    return "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ())
