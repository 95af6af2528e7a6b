"""The listeners of rlcore-megatron's router seams (the registry behind
:func:`rlcore_megatron.seams.add_listener`; the routers call :func:`notify_listeners`). Internal:
other plugins use :mod:`rlcore_megatron.seams`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: a listener is called with a ``rlcore_megatron.routers.RouterSeam`` (typed ``Any`` here: this
#: registry sits below the routers and imports nothing of them)
Listener = Callable[[Any], None]

_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    """Call ``listener(seam)`` with every router seam an engine installs from now on (see the module
    docstring for what a seam offers). Adding a listener already added does nothing."""
    if listener not in _listeners:
        _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop calling ``listener``; removing one that was never added does nothing."""
    if listener in _listeners:
        _listeners.remove(listener)


def notify_listeners(seam: Any) -> None:
    """The engine's side: hand a just-installed seam to every listener, in the order they were added."""
    for listener in list(_listeners):
        listener(seam)
