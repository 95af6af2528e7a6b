"""How a conformance check reports a broken contract: which provider, which hook, which property,
then the numbers (torch's own mismatch report: how many elements, the greatest differences and
where they are)."""

from __future__ import annotations

from typing import Any

import torch


def assert_close(actual: Any, expected: Any, contract: str, **tolerances: Any) -> None:
    """:func:`torch.testing.assert_close` whose failure message starts with ``contract`` (e.g.
    ``"algorithm 'opo' loss: grad() must equal autograd through value()"``) and keeps torch's
    report of the mismatch below it."""
    torch.testing.assert_close(actual, expected, msg=lambda detail: f"{contract}\n{detail}", **tolerances)
