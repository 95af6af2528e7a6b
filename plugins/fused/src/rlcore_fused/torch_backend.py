"""The portable backend: the same statistics and gradients as the Triton kernels, in chunked torch.

Used where there is no GPU (the documented behaviour of ``backend: auto`` on CPU tensors), or
anywhere when ``backend: torch`` is chosen. At most one ``[chunk_tokens, V_local]`` fp32 block of
logits exists at a time, in forward and in backward; the weight is upcast to fp32 once per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore_fused.loss_common import LossResult, ObjectiveFn
from rlcore_fused.softmax_stats import NEG_BIG, empty_record, exchange_records, finalize


@dataclass
class TorchKernels:
    chunk_tokens: int = 2048
    name: str = "torch"

    def _chunks(self, n: int):
        step = max(1, int(self.chunk_tokens))
        for lo in range(0, n, step):
            yield lo, min(lo + step, n)

    def local_record(self, x: torch.Tensor, w_valid: torch.Tensor, labels_local: torch.Tensor,
                     inv_temp: torch.Tensor, compute_entropy: bool, compute_sum_sq: bool = False) -> torch.Tensor:
        """``[4, N]`` record (``[5, N]`` with ``compute_sum_sq``: see :mod:`rlcore_fused.softmax_stats`)
        over this weight's rows."""
        n, v = x.shape[0], w_valid.shape[0]
        rows = 5 if compute_sum_sq else 4
        if v == 0:
            return empty_record(n, x.device, rows)
        record = torch.empty(rows, n, dtype=torch.float32, device=x.device)
        wf = w_valid.float()
        owned = (labels_local >= 0) & (labels_local < v)
        safe = labels_local.clamp(0, v - 1).long()
        for lo, hi in self._chunks(n):
            z = (x[lo:hi].float() @ wf.t()) * inv_temp[lo:hi, None]
            m = z.max(dim=1).values
            zs = z - m[:, None]
            e = torch.exp(zs)
            record[0, lo:hi] = m
            record[1, lo:hi] = e.sum(dim=1)
            record[2, lo:hi] = (e * zs).sum(dim=1) if compute_entropy else 0.0
            target = z.gather(1, safe[lo:hi, None]).squeeze(1)
            record[3, lo:hi] = torch.where(owned[lo:hi], target, torch.full_like(target, NEG_BIG))
            if compute_sum_sq:
                record[4, lo:hi] = (e * e).sum(dim=1)
        return record

    def grads(self, x, w_valid, labels_local, inv_temp, lse, mean_logit, g_lp, g_ent, need_dx, need_dw):
        """``(dX [N, H] in x.dtype, dW [V_valid, H] in w.dtype)`` (None where not needed).

        ``∂L/∂z = g_lp·onehot − p·(g_lp + g_ent·(z − E_p[z]))`` and ``∂L/∂(x·wᵀ) = (∂L/∂z)/τ``.
        """
        n, v = x.shape[0], w_valid.shape[0]
        dx = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
        if v == 0:
            return dx, (torch.zeros(w_valid.shape, dtype=w_valid.dtype, device=w_valid.device) if need_dw else None)
        wf = w_valid.float()
        dw_acc = torch.zeros(wf.shape, dtype=torch.float32, device=x.device) if need_dw else None
        owned = (labels_local >= 0) & (labels_local < v)
        safe = labels_local.clamp(0, v - 1).long()
        for lo, hi in self._chunks(n):
            xf = x[lo:hi].float()
            z = (xf @ wf.t()) * inv_temp[lo:hi, None]
            p = torch.exp(z - lse[lo:hi, None])
            coef = torch.zeros_like(z)
            if g_lp is not None:
                coef += g_lp[lo:hi, None]
            if g_ent is not None:
                coef += g_ent[lo:hi, None] * (z - mean_logit[lo:hi, None])
            dz = -p * coef
            if g_lp is not None:
                hit = torch.where(owned[lo:hi], g_lp[lo:hi], torch.zeros_like(g_lp[lo:hi]))
                dz.scatter_add_(1, safe[lo:hi, None], hit[:, None])
            dz *= inv_temp[lo:hi, None]
            if need_dx:
                dx[lo:hi] = (dz @ wf).to(x.dtype)
            if need_dw:
                dw_acc.addmm_(dz.t(), xf)
        return dx, (dw_acc.to(w_valid.dtype) if need_dw else None)

    def loss_grads(self, x: torch.Tensor, w_valid: torch.Tensor, labels_local: torch.Tensor, inv_temp: torch.Tensor,
                   group, objective: ObjectiveFn, shard_rows: int | None = None) -> LossResult:
        """The fused-loss path (:mod:`rlcore_fused.loss_common`) in chunked torch: per chunk of
        ``chunk_tokens`` rows, fp32 logits once, the record (merged over ``group``), the
        objective's derivatives, then ``∂L/∂logits`` into ``dX`` and an fp32 ``dW``. Every rank
        forms the same chunks (``chunk_tokens``), so ``shard_rows`` is not needed here."""
        n, v = x.shape[0], w_valid.shape[0]
        wf = w_valid.float()
        dx = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        dw_acc = torch.zeros(wf.shape, dtype=torch.float32, device=x.device)
        logp_all = torch.zeros(n, dtype=torch.float32, device=x.device)
        ent_all = torch.zeros(n, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        owned = (labels_local >= 0) & (labels_local < v)
        safe = labels_local.clamp(0, max(v - 1, 0)).long()
        for lo, hi in self._chunks(n):
            xf = x[lo:hi].float()
            it = inv_temp[lo:hi, None]
            if v == 0:
                z = torch.zeros(hi - lo, 0, dtype=torch.float32, device=x.device)
                record = empty_record(hi - lo, x.device)
            else:
                z = (xf @ wf.t()) * it
                m = z.max(dim=1).values
                zs = z - m[:, None]
                e = torch.exp(zs)
                target = z.gather(1, safe[lo:hi, None]).squeeze(1)
                record = torch.stack([m, e.sum(dim=1), (e * zs).sum(dim=1),
                                      torch.where(owned[lo:hi], target, torch.full_like(target, NEG_BIG))])
            logp, ent, lse, mu, _missing = finalize(exchange_records(record, group), True)
            value, g_lp, g_ent = objective(lo, hi, logp, ent)
            logp_all[lo:hi], ent_all[lo:hi] = logp, ent
            total += value.sum()
            if v == 0:
                continue
            p = torch.exp(z - lse[:, None])
            dz = -p * (g_lp[:, None] + g_ent[:, None] * (z - mu[:, None]))
            hit = torch.where(owned[lo:hi], g_lp, torch.zeros_like(g_lp))
            dz.scatter_add_(1, safe[lo:hi, None], hit[:, None])
            dz *= it
            dx[lo:hi] = (dz @ wf).to(x.dtype)
            dw_acc.addmm_(dz.t(), xf)
        return LossResult(total, logp_all, ent_all, dx, dw_acc.to(w_valid.dtype))
