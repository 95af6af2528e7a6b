"""HF checkpoint names ↔ megatron-core parameters, both ways, shard by shard.

Every megatron parameter maps to one or more HF checkpoint tensors through a :class:`ParamMap`:

* ``copy``: one HF tensor, possibly split along ``tp_dim`` over tensor-parallel ranks (vocab
  tensors are padded to ``padded_vocab`` rows first; the padding rows are zero and never
  exported);
* ``qkv``: ``q_proj``/``k_proj``/``v_proj`` fused into megatron's ``linear_qkv``, interleaved by
  query group (``[q of group g, k_g, v_g]`` for each group), so a contiguous split along rows is
  a split by groups — exactly megatron's tensor-parallel layout;
* ``glu``: ``gate_proj``/``up_proj`` fused into ``linear_fc1``; each tensor-parallel rank holds
  ``[gate shard; up shard]``, so the split is per half, not a contiguous slice of the concatenation.

Experts: local expert ``j`` on expert-parallel rank ``r`` is global expert ``r * E_local + j``,
and expert weights are split over the *expert* tensor-parallel group.

MTP depth ``d`` (0-based) has one of two HF layouts (:data:`MTP_LAYOUTS`), read from the
checkpoint's names and written back the same way (:func:`detect_mtp_layout`):

* ``mimo`` (Qwen2 models; names from :mod:`rlcore.engines.mimo_layout`): Xiaomi MiMo's
  ``model.mtp_layers.{d}.*`` — ``token_layernorm`` (megatron ``enorm``), ``hidden_layernorm``
  (``hnorm``), ``input_proj`` (``eh_proj``), ``final_layernorm``, and the decoder block's own
  names directly under the prefix, which is what vLLM's ``MiMoMTP`` loads. ``input_proj``
  multiplies ``[hidden_layernorm(h), token_layernorm(e)]`` where megatron's ``eh_proj``
  multiplies ``[enorm(e), hnorm(h)]``: the two column halves are swapped both ways
  (kind ``swap_halves``; the split is along rows, so each tensor-parallel shard swaps alone).
* ``deepseek``: DeepSeek-V3's ``model.layers.{num_hidden_layers + d}.*`` (``enorm``,
  ``hnorm``, ``eh_proj``, ``shared_head.norm``), read and written unchanged.

Loading (:func:`load_hf_into`) builds each parameter's full tensor from the HF tensors and copies
this rank's shard; every checkpoint tensor must find a place and every parameter must be filled.
Exporting (:func:`export_hf`) walks the parameters in a fixed order that is the same on every
rank, gathers them across the TP group (and experts across the EP group) — several consecutive
tensors in one collective, about one sync bucket's bytes (:data:`GATHER_BYTES`), never the whole
model — and yields HF-named tensors. Every rank must iterate the stream
to the end (the gathers are collectives).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rlcore.engines import mimo_layout
from rlcore.errors import RLCoreError

from rlcore_megatron.hf_config import ModelSpec

#: checkpoint tensors the engine knowingly does not load (DeepSeek-V3 MTP layers repeat the
#: embedding and output head, which megatron shares with the main model; rotary caches)
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


class WeightMapError(RLCoreError):
    """A checkpoint and the megatron model do not correspond."""


@dataclass(frozen=True)
class ParamMap:
    """How one megatron parameter is made of HF checkpoint tensors (see module docstring)."""

    kind: str  # copy | qkv | glu | swap_halves
    hf: tuple[str, ...]
    tp_dim: int | None = None
    vocab: bool = False
    expert: bool = False


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the tensor/expert-parallel groups (``None`` groups: size 1)."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    etp_size: int = 1
    etp_rank: int = 0
    etp_group: Any = None

    @classmethod
    def from_megatron(cls) -> Parallel:
        from megatron.core import parallel_state as ps

        return cls(
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_group=ps.get_expert_model_parallel_group(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_group=ps.get_expert_tensor_parallel_group(),
        )


_LAYER_RULES: tuple[tuple[str, str, tuple[str, ...], int | None], ...] = (
    # (megatron suffix, kind, HF suffixes, tensor-parallel dim)
    ("input_layernorm.weight", "copy", ("input_layernorm.weight",), None),
    # Transformer Engine fuses the pre-attention / pre-MLP norms into the next linear
    ("self_attention.linear_qkv.layer_norm_weight", "copy", ("input_layernorm.weight",), None),
    ("mlp.linear_fc1.layer_norm_weight", "copy", ("post_attention_layernorm.weight",), None),
    ("self_attention.linear_qkv.weight", "qkv",
     ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), 0),
    ("self_attention.linear_qkv.bias", "qkv",
     ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), 0),
    ("self_attention.linear_proj.weight", "copy", ("self_attn.o_proj.weight",), 1),
    ("self_attention.q_layernorm.weight", "copy", ("self_attn.q_norm.weight",), None),
    ("self_attention.k_layernorm.weight", "copy", ("self_attn.k_norm.weight",), None),
    ("pre_mlp_layernorm.weight", "copy", ("post_attention_layernorm.weight",), None),
    ("mlp.linear_fc1.weight", "glu", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0),
    ("mlp.linear_fc2.weight", "copy", ("mlp.down_proj.weight",), 1),
    ("mlp.router.weight", "copy", ("mlp.gate.weight",), None),
    ("mlp.shared_experts.linear_fc1.weight", "glu",
     ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), 0),
    ("mlp.shared_experts.linear_fc2.weight", "copy", ("mlp.shared_expert.down_proj.weight",), 1),
    ("mlp.shared_experts.gate_weight", "copy", ("mlp.shared_expert_gate.weight",), None),
)
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_DECODER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_INNER = ("transformer_layer.", "mtp_model_layer.")
MTP_LAYOUTS = ("mimo", "deepseek")
#: what megatron-core's ``eh_proj`` multiplies (``MultiTokenPredictionLayer``: ``cat(enorm(e), hnorm(h))``)
MEGATRON_EH_PROJ_ORDER = ("embedding", "hidden")
# MiMo's own tensors, in the order core's layout module lists them (token norm, hidden norm,
# input projection, final norm); its input projection's column order decides the swap
_MIMO_TOKEN_NORM, _MIMO_HIDDEN_NORM, _MIMO_INPUT_PROJ, _MIMO_FINAL_NORM = mimo_layout.OWN_TENSORS
_MIMO_PROJ_KIND = "copy" if tuple(mimo_layout.INPUT_PROJ_ORDER) == MEGATRON_EH_PROJ_ORDER else "swap_halves"
_MTP_OWN = {
    "deepseek": {
        "enorm.weight": ("copy", ("enorm.weight",), None),
        "hnorm.weight": ("copy", ("hnorm.weight",), None),
        "eh_proj.weight": ("copy", ("eh_proj.weight",), 0),
        "final_layernorm.weight": ("copy", ("shared_head.norm.weight",), None),
    },
    "mimo": {
        "enorm.weight": ("copy", (_MIMO_TOKEN_NORM,), None),
        "hnorm.weight": ("copy", (_MIMO_HIDDEN_NORM,), None),
        "eh_proj.weight": (_MIMO_PROJ_KIND, (_MIMO_INPUT_PROJ,), 0),
        "final_layernorm.weight": ("copy", (_MIMO_FINAL_NORM,), None),
    },
}


def mtp_hf_prefix(layout: str, spec: ModelSpec, depth: int) -> str:
    """The HF name prefix of MTP depth ``depth`` (0-based) in ``layout``."""
    return mimo_layout.layer_prefix(depth) if layout == "mimo" else f"model.layers.{spec.num_layers + depth}."


def fresh_mtp_layout(model_type: str) -> str:
    """The layout of MTP layers a checkpoint does not have yet: MiMo's over Qwen2 (the model
    MiMo is, and what vLLM's ``MiMoMTP`` serves), DeepSeek-V3's for any other model."""
    return "mimo" if model_type == "qwen2" else "deepseek"


def detect_mtp_layout(spec: ModelSpec, hf_names: set[str] | list[str]) -> str:
    """``mimo`` or ``deepseek``, from the MTP tensors of a checkpoint (:func:`fresh_mtp_layout`
    when it has none); a checkpoint with both is an error."""
    mimo = any(mimo_layout.is_mtp_name(n) for n in hf_names)
    deepseek = spec.mtp_layers > 0 and any(n.startswith(f"model.layers.{spec.num_layers}.") for n in hf_names)
    if mimo and deepseek:
        raise WeightMapError(
            f"the checkpoint has MTP tensors in both layouts ({mimo_layout.PREFIX}* and model.layers.{spec.num_layers}.*)"
        )
    if mimo:
        return "mimo"
    return "deepseek" if deepseek else fresh_mtp_layout(spec.model_type)


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """Exchange the two halves of dim 1 (``[a | b]`` → ``[b | a]``; its own inverse)."""
    half = t.shape[1] // 2
    return torch.cat([t[:, half:], t[:, :half]], dim=1)


class NameMap:
    """Megatron parameter names (``decoder.*``, ``embedding.*``, ``output_layer.*``, and
    ``mtp.layers.*`` for the engine's MTP block) → :class:`ParamMap`."""

    def __init__(self, spec: ModelSpec, par: Parallel, mtp_layout: str = "mimo"):
        if mtp_layout not in MTP_LAYOUTS:
            raise ValueError(f"mtp_layout must be one of {MTP_LAYOUTS}, got {mtp_layout!r}")
        self.spec = spec
        self.par = par
        self.mtp_layout = mtp_layout
        self.experts_per_rank = spec.num_experts // par.ep_size if spec.num_experts else 0

    def _layer(self, hf_prefix: str, suffix: str) -> ParamMap:
        m = _EXPERT_RE.match(suffix)
        if m:
            e = self.par.ep_rank * self.experts_per_rank + int(m.group(1))
            if m.group(2) == "linear_fc1":
                return ParamMap("glu", (f"{hf_prefix}mlp.experts.{e}.gate_proj.weight",
                                        f"{hf_prefix}mlp.experts.{e}.up_proj.weight"), 0, expert=True)
            return ParamMap("copy", (f"{hf_prefix}mlp.experts.{e}.down_proj.weight",), 1, expert=True)
        for msuffix, kind, hf, tp_dim in _LAYER_RULES:
            if suffix == msuffix:
                return ParamMap(kind, tuple(hf_prefix + h for h in hf), tp_dim)
        raise WeightMapError(f"the megatron parameter suffix {suffix!r} has no HF checkpoint name")

    def __call__(self, name: str) -> ParamMap:
        if name == "embedding.word_embeddings.weight":
            return ParamMap("copy", ("model.embed_tokens.weight",), 0, vocab=True)
        if name == "output_layer.weight":
            return ParamMap("copy", ("lm_head.weight",), 0, vocab=True)
        if name == "decoder.final_layernorm.weight":
            return ParamMap("copy", ("model.norm.weight",), None)
        m = _DECODER_RE.match(name)
        if m:
            return self._layer(f"model.layers.{int(m.group(1))}.", m.group(2))
        m = _MTP_RE.match(name)
        if m:
            prefix = mtp_hf_prefix(self.mtp_layout, self.spec, int(m.group(1)))
            rest = m.group(2)
            own = _MTP_OWN[self.mtp_layout]
            if rest in own:
                kind, hf, tp_dim = own[rest]
                return ParamMap(kind, tuple(prefix + h for h in hf), tp_dim)
            for inner in _MTP_INNER:
                if rest.startswith(inner):
                    return self._layer(prefix, rest[len(inner):])
        raise WeightMapError(f"the megatron parameter {name!r} has no HF checkpoint name")


# ------------------------------------------------------------------------------------------
# HF → megatron
# ------------------------------------------------------------------------------------------


def _qkv_full(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    groups, hd = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // groups
    rest = q.shape[1:]
    qg = q.reshape(groups, per * hd, *rest)
    kg = k.reshape(groups, hd, *rest)
    vg = v.reshape(groups, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(groups * (per + 2) * hd, *rest)


def _split_qkv(spec: ModelSpec, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, hd = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // groups
    rest = full.shape[1:]
    g = full.reshape(groups, (per + 2) * hd, *rest)
    q, k, v = torch.split(g, [per * hd, hd, hd], dim=1)
    return (q.reshape(groups * per * hd, *rest), k.reshape(groups * hd, *rest), v.reshape(groups * hd, *rest))


def _shard(t: torch.Tensor, dim: int | None, size: int, rank: int) -> torch.Tensor:
    if dim is None or size == 1:
        return t
    if t.shape[dim] % size:
        raise WeightMapError(f"dimension {dim} of a {tuple(t.shape)} tensor does not split over {size} ranks")
    return t.chunk(size, dim=dim)[rank]


def local_shard(pm: ParamMap, spec: ModelSpec, par: Parallel, padded_vocab: int,
                get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """This rank's shard of the parameter ``pm`` describes, built from HF tensors."""
    size, rank = (par.etp_size, par.etp_rank) if pm.expert else (par.tp_size, par.tp_rank)
    hf = [get(n) for n in pm.hf]
    if pm.kind == "copy":
        full = hf[0]
        if pm.vocab and full.shape[0] < padded_vocab:
            pad = full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])
            full = torch.cat([full, pad])
        return _shard(full, pm.tp_dim, size, rank)
    if pm.kind == "qkv":
        return _shard(_qkv_full(spec, *hf), 0, size, rank)
    if pm.kind == "glu":
        gate, up = hf
        return torch.cat([_shard(gate, 0, size, rank), _shard(up, 0, size, rank)])
    if pm.kind == "swap_halves":
        return _shard(swap_halves(hf[0]), pm.tp_dim, size, rank)
    raise WeightMapError(f"unknown parameter kind {pm.kind!r}")


def is_ignored_hf_name(spec: ModelSpec, name: str) -> bool:
    if name.endswith(IGNORED_HF_SUFFIXES):
        return True
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    return bool(m and int(m.group(1)) >= spec.num_layers and m.group(2) in _MTP_SHARED_COPIES)


@torch.no_grad()
def load_hf_into(named_params: list[tuple[str, torch.nn.Parameter]], names: NameMap, padded_vocab: int,
                 hf_names: set[str], get: Callable[[str], torch.Tensor], *,
                 tied: bool, allow_unused_prefixes: tuple[str, ...] = ()) -> None:
    """Copy HF tensors into ``named_params`` (see module docstring); raise on any mismatch.

    ``allow_unused_prefixes``: HF tensors that may stay unused (MTP layers of a checkpoint when
    the engine was told not to build them would be an error instead; this is for ``lm_head``
    of a tied checkpoint that still carries it)."""
    used: set[str] = set()
    for name, p in named_params:
        pm = names(name)
        missing = [n for n in pm.hf if n not in hf_names]
        if missing:
            raise WeightMapError(
                f"the HF checkpoint has no {missing[0]!r}, needed for megatron parameter {name!r}"
            )
        shard = local_shard(pm, names.spec, names.par, padded_vocab, get)
        if tuple(shard.shape) != tuple(p.shape):
            raise WeightMapError(
                f"megatron parameter {name!r} is {tuple(p.shape)} on this rank, but {', '.join(pm.hf)} "
                f"give a {tuple(shard.shape)} shard"
            )
        p.copy_(shard.to(p.dtype))
        used.update(pm.hf)
    unused = sorted(
        n for n in hf_names - used
        if not is_ignored_hf_name(names.spec, n) and not n.startswith(allow_unused_prefixes)
        and not (tied and n == "lm_head.weight")
        and not _expert_of_other_rank(names, n)
    )
    if unused:
        raise WeightMapError(
            f"{len(unused)} HF checkpoint tensor(s) have no place in the megatron model, e.g. "
            f"{', '.join(unused[:4])}"
        )


def _expert_of_other_rank(names: NameMap, hf_name: str) -> bool:
    m = re.search(r"\.mlp\.experts\.(\d+)\.", hf_name)
    if not m or names.par.ep_size == 1:
        return False
    return int(m.group(1)) // names.experts_per_rank != names.par.ep_rank


# ------------------------------------------------------------------------------------------
# megatron → HF
# ------------------------------------------------------------------------------------------


#: the gathered bytes one collective of the export carries at most: the sync's default bucket
#: (``sync.bucket_mb`` = 64), so a push makes about one all-gather per bucket; a tensor larger than
#: this is gathered alone
GATHER_BYTES = 64 << 20


def _all_gather_many(tensors: list[torch.Tensor], group: Any, size: int, rank: int) -> list[list[torch.Tensor]]:
    """Every rank's shard of each of ``tensors`` (one dtype, one device), in one collective: this
    rank's shards are copied into its own block of one flat buffer (one ``_foreach_copy_``), which
    is gathered in place into ``size`` rank blocks (FSDP2's layout: no separate input buffer);
    returns, per tensor, its ``size`` pieces as views of the gathered buffer."""
    if size == 1 or not tensors:
        return [[t] for t in tensors]
    numels = [t.numel() for t in tensors]
    total = sum(numels)
    gathered = tensors[0].new_empty(size * total)
    own = gathered.narrow(0, rank * total, total)
    torch._foreach_copy_(list(torch.split(own, numels)), [t.reshape(-1) for t in tensors])
    # all_gather_single is all_gather_into_tensor's newer name (torch >= 2.13 deprecates the old one)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_into(gathered, own, group=group)
    blocks = gathered.view(size, total)
    pieces, offset = [], 0
    for t, n in zip(tensors, numels, strict=True):
        pieces.append([blocks[r, offset:offset + n].view(t.shape) for r in range(size)])
        offset += n
    return pieces


def _merge(pm: ParamMap, spec: ModelSpec, parts: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    if pm.kind == "copy":
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=pm.tp_dim or 0)
        if pm.vocab:
            full = full[: spec.vocab_size]
        return [(pm.hf[0], full)]
    if pm.kind == "qkv":
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return list(zip(pm.hf, _split_qkv(spec, full), strict=True))
    if pm.kind == "glu":
        halves = [p.chunk(2, dim=0) for p in parts]
        gate = halves[0][0] if len(parts) == 1 else torch.cat([h[0] for h in halves])
        up = halves[0][1] if len(parts) == 1 else torch.cat([h[1] for h in halves])
        return [(pm.hf[0], gate), (pm.hf[1], up)]
    if pm.kind == "swap_halves":
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=pm.tp_dim or 0)
        return [(pm.hf[0], swap_halves(full))]
    raise WeightMapError(f"unknown parameter kind {pm.kind!r}")


def export_hf(named_params: list[tuple[str, torch.Tensor]], names: NameMap,
              skip: Callable[[str], bool] = lambda name: False,
              gather_bytes: int = GATHER_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, full tensor)`` (see module docstring). ``skip(megatron_name)`` leaves
    parameters out (identically on every rank).

    Consecutive sharded parameters are gathered together, one collective per group of at most
    ``gather_bytes`` gathered bytes (about one bucket of the sync), then each is reordered out of
    the gathered buffer; the stream's order and bytes are those of a gather per tensor. At most
    one group's gather is alive at a time."""
    if gather_bytes < 1:
        raise ValueError(f"gather_bytes must be >= 1, got {gather_bytes}")
    par = names.par
    group: list[tuple[ParamMap, torch.Tensor]] = []
    group_key: tuple[Any, ...] | None = None
    group_bytes = 0
    for name, p in named_params:
        if skip(name):
            continue
        pm = names(name)
        t = p.detach()
        key, nbytes = _gather_kind(pm, t, par)
        if group and key is not None and (
            (group_key is not None and key != group_key) or group_bytes + nbytes > gather_bytes
        ):
            yield from _gathered_group(group, group_key, names)
            group, group_key, group_bytes = [], None, 0
        group.append((pm, t))
        if key is not None:
            group_key, group_bytes = key, group_bytes + nbytes
    if group:
        yield from _gathered_group(group, group_key, names)


def _gather_kind(pm: ParamMap, t: torch.Tensor, par: Parallel) -> tuple[tuple[Any, ...] | None, int]:
    """Which collective group ``pm``'s tensor joins (``None``: none, it is exported as it is) and
    how many bytes its gather produces."""
    if pm.expert:
        size = (par.etp_size if pm.tp_dim is not None else 1) * par.ep_size
        key: tuple[Any, ...] = ("expert", t.dtype, t.device)
    else:
        size = par.tp_size if pm.tp_dim is not None else 1
        key = ("tp", t.dtype, t.device)
    if size == 1:
        return None, 0
    return key, t.numel() * t.element_size() * size


def _gathered_group(group: list[tuple[ParamMap, torch.Tensor]], key: tuple[Any, ...] | None,
                    names: NameMap) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of ``group``'s parameters, in their order, from one all-gather (experts:
    one over the expert-TP group, then one over the EP group)."""
    par, spec = names.par, names.spec
    if key is None or key[0] == "tp":
        sharded = [t for pm, t in group if not pm.expert and pm.tp_dim is not None and par.tp_size > 1]
        pieces = iter(_all_gather_many(sharded, par.tp_group, par.tp_size, par.tp_rank))
        for pm, t in group:
            gathered = not pm.expert and pm.tp_dim is not None and par.tp_size > 1
            yield from _merge(pm, spec, next(pieces) if gathered else [t])
        return
    yield from _owning_last(_gathered_experts(group, names))


def _gathered_experts(group: list[tuple[ParamMap, torch.Tensor]],
                      names: NameMap) -> Iterator[tuple[str, torch.Tensor]]:
    """Experts: first the expert-TP gather of this rank's local experts j, then every EP rank's
    experts j (global ids r * E_local + j); unsharded parameters among them pass through. The
    yielded experts are views of the EP gather's buffer."""
    par, spec = names.par, names.spec
    etp = [t for pm, t in group if pm.expert and pm.tp_dim is not None]
    etp_pieces = iter(_all_gather_many(etp, par.etp_group, par.etp_size, par.etp_rank))
    local: list[tuple[ParamMap, Any]] = []
    for pm, t in group:
        if not pm.expert:
            local.append((pm, t))
        else:
            local.append((pm, _merge(pm, spec, next(etp_pieces) if pm.tp_dim is not None else [t])))
    del etp_pieces  # the expert-TP buffer is free before the EP gather
    fulls = [full for pm, merged in local if pm.expert for _, full in merged]
    ep_pieces = iter(_all_gather_many(fulls, par.ep_group, par.ep_size, par.ep_rank))
    for pm, merged in local:
        if not pm.expert:
            yield from _merge(pm, spec, [merged])
            continue
        for hf_name, _ in merged:
            for src, expert_tensor in enumerate(next(ep_pieces)):
                yield _renumber_expert(hf_name, names, src), expert_tensor


def _owning_last(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``items``, the last one copied: a consumer keeps its loop variable while it asks for the
    next tensor, and a view would keep the whole group's buffer alive during the next gather."""
    held = next(items, None)
    for item in items:
        yield held
        held = item
    if held is not None:
        yield held[0], held[1].clone()


def _renumber_expert(hf_name: str, names: NameMap, src: int) -> str:
    """``hf_name`` was built for this rank's global expert id; rename it for rank ``src``'s."""
    m = re.search(r"\.mlp\.experts\.(\d+)\.", hf_name)
    assert m is not None
    local = int(m.group(1)) - names.par.ep_rank * names.experts_per_rank
    e = src * names.experts_per_rank + local
    return hf_name[: m.start(1)] + str(e) + hf_name[m.end(1):]
