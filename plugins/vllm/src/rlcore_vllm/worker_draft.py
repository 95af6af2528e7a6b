"""The speculative draft's side of a push, inside vLLM's worker (used by :mod:`rlcore_vllm.worker_ext`).

With ``speculative_config={"method": "mtp"}`` the draft is ``model_runner.drafter.model``, or
``model_runner.speculator.model`` in vLLM's Model Runner V2 (:data:`DRAFT_HOLDERS`; for the MiMo
layout vLLM's ``MiMoMTP``), a second model that shares the target's embedding and LM head
modules. The target's weight mapper drops ``model.mtp_layers.*``, so a push that only reloads
the target leaves the draft at its start weights, silently. Here the MTP tensors of every bucket
go to the draft instead, through the same layerwise reload as the target
(``initialize_layerwise_reload`` on the draft, its ``load_weights``, ``finalize_layerwise_reload``
with the draft's model config): a direct ``load_weights`` on the live draft kills the engine,
because CPU linear weights are prepacked after loading. Modules shared with the target are
already in reload state from the target's initialisation (vLLM skips them), so they are loaded
and processed once, with the target.

A draft tensor never disappears without a trace: with a draft, every one goes to it and its
coverage is checked (every draft parameter but the shared ones must be loaded); without a draft
(speculation off) they are counted as ``draft_tensors_unserved``; with the diagnostic skip they
are counted as ``draft_tensors_skipped`` and the draft keeps its version.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore_vllm.speculative import is_draft_tensor

#: where a vLLM model runner keeps its speculative draft: ``drafter`` in the V1 runner (the CPU
#: build's, and any GPU model vLLM does not run on V2), ``speculator`` in Model Runner V2 (vLLM
#: 0.26's default on GPUs for dense models, e.g. the MiMo draft's target)
DRAFT_HOLDERS = ("drafter", "speculator")


def draft_model(model_runner: Any) -> torch.nn.Module | None:
    """The speculative draft model of a vLLM model runner, or None without one."""
    for holder in DRAFT_HOLDERS:
        model = getattr(getattr(model_runner, holder, None), "model", None)
        if isinstance(model, torch.nn.Module):
            return model
    return None


def own_parameters(draft: torch.nn.Module, target: torch.nn.Module) -> set[str]:
    """The draft's parameter names, less those it shares with the target (embedding, LM head)."""
    shared = {id(p) for p in target.parameters()}
    return {name for name, p in draft.named_parameters() if id(p) not in shared}


class DraftUpdate:
    """One push's state for the draft (created by ``rlcore_begin_update``)."""

    def __init__(self, model_runner: Any, target: torch.nn.Module, *, skip: bool):
        self.model = draft_model(model_runner)
        self.skip = bool(skip)
        self.expected = own_parameters(self.model, target) if self.model is not None else set()
        self.loaded: set[str] = set()
        self.received: set[str] = set()
        self.skipped = 0
        self.unserved = 0
        #: draft tensors received but loaded nowhere on purpose (no draft, or the diagnostic skip)
        self.not_loaded: set[str] = set()
        self.active = False

    def begin(self) -> None:
        """Put the draft into layerwise reload (after the target, so shared modules are skipped)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.model is not None and not self.skip:
            initialize_layerwise_reload(self.model)
            self.active = True

    def split(self, views: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Keep this bucket's draft tensors for :meth:`load`; return the target's."""
        target, self._pending = [], []
        for name, t in views:
            (self._pending if is_draft_tensor(name) else target).append((name, t))
        return target

    def load(self, stream) -> None:
        """Load the tensors :meth:`split` kept (``stream`` wraps them to track the current name)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if self.model is None:
            self.unserved += len(pending)
            self.not_loaded.update(name for name, _ in pending)
            return
        if self.skip:
            self.skipped += len(pending)
            self.not_loaded.update(name for name, _ in pending)
            return
        loaded = self.model.load_weights(stream(pending))
        if loaded:
            self.loaded.update(loaded)
        self.received.update(name for name, _ in pending)

    def finish(self, model_config: Any) -> dict[str, Any]:
        """Finish the draft's reload; what it got, for the trainer's checks."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.active:
            self.active = False
            finalize_layerwise_reload(self.model, model_config)
        missing = sorted(self.expected - self.loaded) if self.model is not None and not self.skip else []
        return {"has_draft": self.model is not None, "draft_params": len(self.expected),
                "draft_received": len(self.received), "draft_missing": missing[:20], "draft_num_missing": len(missing),
                "draft_tensors_skipped": self.skipped, "draft_tensors_unserved": self.unserved,
                "draft_complete": self.model is not None and not self.skip and bool(self.received) and not missing}

    def abort(self, model_config: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.active:
            self.active = False
            finalize_layerwise_reload(self.model, model_config)


def draft_model_config(vllm_config: Any) -> Any:
    """The draft's model config (its finalize needs the draft's dtype and attention settings)."""
    spec = getattr(vllm_config, "speculative_config", None)
    cfg = getattr(spec, "draft_model_config", None)
    return cfg if cfg is not None else vllm_config.model_config
