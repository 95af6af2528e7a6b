"""Helpers for tests and benchmark scripts of the megatron engine's router seam (the engine never
imports this module)."""

from __future__ import annotations

from typing import Any


def perturb_routers(engine: Any, seed: int = 1, scale: float = 3.0) -> None:
    """Add seeded Gaussian noise (``scale``) to every router weight the engine's seam knows, so
    native routing changes; the same noise on every rank (the generator is on the CPU)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for site in engine.seam.sites:
            w = site.router.weight
            w.add_((torch.randn(w.shape, generator=g) * scale).to(w.device))
