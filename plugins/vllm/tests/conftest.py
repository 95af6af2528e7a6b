"""The vLLM tests' helpers (mimo_checkpoint) live next to the tests; pytest runs with
--import-mode=importlib, which does not put this directory on sys.path by itself."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
