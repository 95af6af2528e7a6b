"""The name transformers gives the KV cache, as an argument of a model's ``forward`` (and of the
mask helpers) and as a field of its output: ``cache`` in transformers 5.x, which still takes
``past_key_values`` but warns on every call (a ``FutureWarning``: "``past_key_values`` is deprecated
and will be removed in version 5.40.0 ... Use ``cache`` instead"), and ``past_key_values`` before.
Detected from the signature, not from version strings, and passed under the name the installed
transformers expects, so a default run prints no warning and keeps working once the old name is
removed."""

from __future__ import annotations

import inspect
from typing import Any

OLD_NAME = "past_key_values"
NEW_NAME = "cache"


def cache_arg(fn: Any) -> str:
    """The keyword under which ``fn`` (a ``forward``, ``create_causal_mask``) takes the KV cache, and
    the field of the model output that returns it."""
    try:
        params = inspect.signature(fn).parameters  # follows the decorators' __wrapped__ to the real signature
    except (TypeError, ValueError):
        return OLD_NAME
    return NEW_NAME if NEW_NAME in params else OLD_NAME

