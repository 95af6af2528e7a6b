"""LoRA (``lora.*``): low-rank adapters trained on a frozen base model, through PEFT.

With ``lora.rank`` > 0 the ``hf`` engine wraps the ``nn.Linear`` layers named by
``lora.target_modules`` (the last part of a module's name: the attention and MLP projections by
default; an MoE model's fused experts are never wrapped) with PEFT's LoRA layers, in place: the
model's forward is unchanged, the base is frozen, the optimizer sees only the adapters. The KL
reference is the same model with the adapters switched off (no second copy). A checkpoint holds the
adapters and the optimizer, not the base (rebuilt from ``engine.model``).

What travels to the rollout (``lora.push``): ``adapter`` sends the adapters' tensors only, in
PEFT's saved names (``base_model.model.<module>.lora_A.weight``), to a backend that declares
:attr:`~rlcore.types.Cap.RECEIVE_ADAPTERS` and wraps its own copy of the base the same way
(:class:`Adapters` over the model it loaded); ``merged`` sends full weights, ``W + scaling · B @ A``
under the checkpoint names, to any backend; ``auto`` is ``adapter`` where the selected backend
declares the capability. Either way the push is verified as a full push is (coverage and checksums
of what the backend holds: the adapters, or the merged weights).

The model directory an engine writes (``save_hf``: the rollout's start, the run's exports) holds the
base in HF form and the adapters in ``adapter/`` (``adapter_config.json`` and
``adapter_model.safetensors``: a PEFT adapter directory, loadable by ``PeftModel.from_pretrained``
and by vLLM's LoRA loader); with ``lora.export_merged`` an export also holds ``merged/``, the merged
model as a plain HF directory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.errors import CheckpointError, ConfigError, WeightSyncError
from rlcore.types import Cap, RequiresCapability

if TYPE_CHECKING:
    import torch

__all__ = [
    "ADAPTER_DIR", "ADAPTER_FILE", "Adapters", "LORA_ADAPTER_PUSH", "LORA_ENGINE", "LORA_PUSH_MODES", "LoraSettings",
    "MERGED_DIR", "adapter_state", "check_lora", "load_adapter_state", "lora_on", "pushes_adapter",
]

#: ``lora.push``: what a push carries (see the module docstring)
LORA_PUSH_MODES = ("auto", "adapter", "merged")
#: the projections of the attention and MLP blocks of Llama/Qwen-style models
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: inside a model directory: the PEFT adapter, and (``lora.export_merged``) the merged model
ADAPTER_DIR = "adapter"
ADAPTER_FILE = "adapter_model.safetensors"
MERGED_DIR = "merged"
#: PEFT's adapter name for the one adapter rlcore trains, and the prefix of its saved tensor names
_ADAPTER = "default"
_SAVED_PREFIX = "base_model.model."


@dataclass
class LoraSettings:
    """``rank``: the adapters' rank (0: off, full fine-tuning); ``alpha``: the scale numerator
    (updates are scaled by ``alpha / rank``); ``dropout`` on the adapters' input while training;
    ``target_modules``: the last name part of the linear layers to adapt; ``export_merged``: the run's
    exports also hold the merged model (``merged/``); ``push``: ``auto``, ``adapter`` or ``merged``
    (:mod:`rlcore.lora`)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    export_merged: bool = False
    push: str = "auto"


def lora_on(cfg: Any) -> bool:
    return int(cfg.lora.rank) > 0


def check_lora(cfg: Any) -> None:
    """What the schema's ranges do not say: targets are names."""
    if not lora_on(cfg):
        return
    targets = list(cfg.lora.target_modules or [])
    if not targets or not all(isinstance(t, str) and t and "." not in t for t in targets):
        raise ConfigError(f"lora.target_modules={targets!r}: name the linear layers to adapt by the last part of "
                          f"their module name, e.g. [q_proj, v_proj]", key="lora.target_modules")


def pushes_adapter(cfg: Any, backend_capabilities: Any) -> bool:
    """Whether this run's pushes carry the adapters only (else full, merged weights)."""
    if not lora_on(cfg) or cfg.lora.push == "merged":
        return False
    return cfg.lora.push == "adapter" or Cap.RECEIVE_ADAPTERS in backend_capabilities


#: lora.rank > 0 needs an engine that trains adapters (core's hf engine does; rlcore-megatron does not)
LORA_ENGINE = RequiresCapability(
    role="engine", capability=Cap.LORA, when=lora_on,
    reason=lambda cfg: (f"lora.rank={cfg.lora.rank} trains LoRA adapters; use engine.name=hf, or lora.rank=0 for "
                        f"full fine-tuning"),
)
#: lora.push=adapter needs a backend that loads adapter pushes
LORA_ADAPTER_PUSH = RequiresCapability(
    role="rollout_backend", capability=Cap.RECEIVE_ADAPTERS,
    when=lambda cfg: lora_on(cfg) and cfg.lora.push == "adapter",
    reason="lora.push='adapter' sends the adapters only; set lora.push=merged (full weights) or auto for a backend "
           "that loads no adapters",
)


def _peft_config(settings: Any, modules: list[str]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha), lora_dropout=float(settings.dropout),
                      target_modules=modules, bias="none")


class Adapters:
    """The LoRA adapters of one transformers model, wrapped in place by PEFT (``peft`` is imported
    here only: a run without LoRA never loads it)."""

    def __init__(self, model: Any, settings: Any):
        import torch  # not at the top: the config (which reads this module's settings) imports no torch

        try:
            from peft import get_peft_model
        except ImportError as exc:
            raise ConfigError("lora.rank > 0 trains LoRA adapters with PEFT, which is not installed: "
                              "pip install 'rlcore[lora]'", key="lora.rank") from exc
        targets = set(settings.target_modules)
        # explicit module names: only nn.Linear layers (PEFT would also wrap an MoE block's fused experts)
        modules = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1]
                   in targets and n.rsplit(".", 1)[-1] != "lm_head"]
        if not modules:
            raise ConfigError(f"lora.target_modules={sorted(targets)}: the model ({model.config.model_type}) has no "
                              f"linear layer of those names", key="lora.target_modules")
        self.model = model
        self.peft = get_peft_model(model, _peft_config(settings, modules))  # wraps `model` itself
        self.modules = modules
        self.settings = {"rank": int(settings.rank), "alpha": float(settings.alpha),
                         "target_modules": sorted(targets)}
        self._layers = {n: m for n, m in model.named_modules() if n in set(modules)}

    # ------------------------------------------------------------------ tensors ----------

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(saved name, live parameter)`` of every adapter tensor, in PEFT's saved names."""
        marker = f".{_ADAPTER}."
        for name, p in self.model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                yield _SAVED_PREFIX + name.replace(marker, "."), p

    def views(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())

    def merged(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, tensor)`` of the whole model with the adapters merged into their
        layers' weights (``W + scaling · B @ A``, new tensors; every other weight is the live one)."""
        import torch

        from rlcore.engines.hf_names import checkpoint_tensors

        for name, t in checkpoint_tensors(self.model):
            if ".lora_A." in name or ".lora_B." in name:
                continue
            if ".base_layer." in name:
                module, leaf = name.split(".base_layer.", 1)
                if leaf == "weight":
                    with torch.no_grad():
                        t = t + self._layers[module].get_delta_weight(_ADAPTER).to(t.dtype)
                name = f"{module}.{leaf}"
            yield name, t

    def base_state(self) -> dict[str, torch.Tensor]:
        """The base model's state dict in its own names (the adapters left out)."""
        return {k.replace(".base_layer.", "."): v for k, v in self.model.state_dict().items()
                if ".lora_A." not in k and ".lora_B." not in k}

    def merged_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the adapters merged (its own names, for ``save_pretrained``)."""
        import torch

        out = self.base_state()
        with torch.no_grad():
            for module, layer in self._layers.items():
                key = f"{module}.weight"
                out[key] = out[key] + layer.get_delta_weight(_ADAPTER).to(out[key].dtype)
        return out

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: the adapters switched off for the calls inside."""
        with self.peft.disable_adapter():
            yield

    # ------------------------------------------------------------------ files ------------

    def save(self, directory: str | Path) -> Path:
        """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.peft.peft_config[_ADAPTER].save_pretrained(str(d))
        save_file({n: t.detach().contiguous().cpu() for n, t in self.tensors()}, str(d / ADAPTER_FILE),
                  metadata={"format": "pt"})
        return d

    def load(self, directory: str | Path) -> None:
        """Copy a saved adapter (:meth:`save`) into the live adapters, every tensor checked."""
        from safetensors.torch import load_file

        path = Path(directory) / ADAPTER_FILE
        self.load_tensors(load_file(str(path)), where=str(path))

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        import torch

        views = self.views()
        missing = sorted(set(views) - set(tensors))
        unknown = sorted(set(tensors) - set(views))
        bad = [n for n in views if n in tensors and tuple(tensors[n].shape) != tuple(views[n].shape)]
        if missing or unknown or bad:
            raise WeightSyncError(
                f"{where}: the adapter does not fit this model's LoRA layers ({self.settings}): "
                f"{len(missing)} missing (e.g. {missing[:2]}), {len(unknown)} unknown (e.g. {unknown[:2]}), "
                f"{len(bad)} of another shape (e.g. {bad[:2]})", receiver_version=None)
        with torch.no_grad():
            for n, v in views.items():
                v.copy_(tensors[n])


def adapter_state(adapters: Adapters) -> dict[str, Any]:
    """What a checkpoint holds of a LoRA engine's weights: the adapters and their settings."""
    return {"lora": dict(adapters.settings), "adapter": {n: t.detach().clone() for n, t in adapters.tensors()}}


def load_adapter_state(adapters: Adapters, state: Mapping[str, Any]) -> None:
    if "adapter" not in state:
        raise CheckpointError("the checkpoint holds full model weights, but this run trains LoRA adapters "
                              "(lora.rank > 0): resume it with lora.rank=0")
    if dict(state.get("lora") or {}) != adapters.settings:
        raise CheckpointError(f"the checkpoint's LoRA adapters were trained with {state.get('lora')}, this run's are "
                              f"{adapters.settings}")
    adapters.load_tensors(state["adapter"], where="the checkpoint")

