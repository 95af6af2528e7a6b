"""docs/algorithms.md gives each of this plugin's public losses and estimators with its defaults
(core's own are checked by tests/test_docs.py): built from the doc's text, each equals the one
built with the code's defaults, and every class of the public modules is listed."""

import importlib
import re
from pathlib import Path

import rlcore_algorithms

DOC = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"


def test_public_losses_and_estimators_are_documented_with_their_defaults():
    section = DOC.read_text().split("rlcore-algorithms' losses and estimators are public", 1)[1]
    rows = dict(re.findall(r"^\| `(\w+\.\w+)` \| `(\w+\([^`]*\))` \|", section.split("\n## ", 1)[0], re.M))
    public = {f"{mod}.{name}" for mod in rlcore_algorithms.__all__
              for name, obj in vars(importlib.import_module(f"rlcore_algorithms.{mod}")).items()
              if isinstance(obj, type) and obj.__module__ == f"rlcore_algorithms.{mod}"}
    assert public <= set(rows), f"docs/algorithms.md does not list {sorted(public - set(rows))}"
    for dotted, call in rows.items():
        mod, name = dotted.split(".")
        cls = getattr(importlib.import_module(f"rlcore_algorithms.{mod}"), name)
        assert call.startswith(f"{name}(")
        assert eval(call, {name: cls}) == cls(), f"docs/algorithms.md shows {call}, the defaults differ"
