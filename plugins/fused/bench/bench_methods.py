"""The heads the benchmark compares, each behind one interface (:class:`Method`): rlcore-fused, a
naive torch head, Liger, cut-cross-entropy and verl's kernel (loaded from its wheel)."""

from __future__ import annotations

import importlib
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch
from rlcore.types import HeadInput, VocabShard
from rlcore_fused.head import FusedHead


class Method:
    """A head under test: ``forward(h, w, labels) -> (logprob, entropy or None)`` in fp32."""

    name = "?"
    has_entropy = True

    def forward(self, h, w, labels):  # pragma: no cover - interface
        raise NotImplementedError


class Fused(Method):
    name = "fused"

    def __init__(self, head=None, mask=None, temperature=1.0):
        self.head = head or FusedHead(backend="triton")
        self.mask = mask
        self.temperature = temperature

    def forward(self, h, w, labels):
        out = self.head(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(w.shape[0]),
                                  loss_mask=self.mask, temperature=self.temperature))
        return out.logprobs, out.entropy


class Naive(Method):
    name = "naive"

    def forward(self, h, w, labels):
        logits = (h @ w.t()).float()
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        lp = logp.gather(1, labels[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1)
        return lp, ent


class Liger(Method):
    name = "liger"
    has_entropy = False

    def __init__(self):
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        self.fn = LigerFusedLinearCrossEntropyFunction

    def forward(self, h, w, labels):
        loss = self.fn.apply(h, w, labels, None, None, -100, 0.0, 0.0, "none")[0]
        return -loss.float(), None


class CCE(Method):
    has_entropy = False

    def __init__(self, filter_eps):
        from cut_cross_entropy import linear_cross_entropy

        self.fn = linear_cross_entropy
        self.filter_eps = filter_eps
        self.name = "cce" if filter_eps == "high" else "cce-exact"

    def forward(self, h, w, labels):
        return -self.fn(h, w, labels, reduction="none", filter_eps=self.filter_eps).float(), None


class Verl(Method):
    name = "verl"

    def __init__(self, wheel: Path):
        self.fn = load_verl_linear_cross_entropy(wheel)

    def forward(self, h, w, labels):
        lp, ent = self.fn(h, w, labels, 1.0, "none", None)
        return lp, ent


def load_verl_linear_cross_entropy(wheel: Path):
    """verl's kernel files, loaded from its wheel with a stub ``verl.utils.device`` (importing the
    real ``verl`` package pulls in ray, tensordict and transformers)."""
    root = Path(tempfile.mkdtemp(prefix="verl-kernel-"))
    with zipfile.ZipFile(wheel) as zf:
        for name in ("verl/utils/kernel/kernels.py", "verl/utils/kernel/linear_cross_entropy.py"):
            zf.extract(name, root)
    for pkg in ("verl", "verl.utils", "verl.utils.kernel"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root / pkg.replace(".", "/"))]
        sys.modules[pkg] = mod
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_capability = lambda *a: torch.cuda.get_device_capability(*a)
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    sys.modules["verl.utils.device"] = device
    lce = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    return lce.linear_cross_entropy
