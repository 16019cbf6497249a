"""Per-process state: the one place where dask_overlap keeps anything per process.

Everything the package keeps per process (the runtimes of the threaded scheduler, the
runtimes a worker plugin built, the worker metrics installed, the cuda backend's streams,
device pools and kernels) lives in a :class:`Registry` made here, so that all of it can
be found in one list (:func:`registries`) and is forgotten together in a child made by
``fork``: its threads, streams and pools are the parent's and do not exist there (a child
that reused them would wait forever on its first partition). A forked child starts
empty, and builds its own runtime on first use.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "registries"]

K = TypeVar("K")
V = TypeVar("V")

_registries: list[Registry[Any, Any]] = []
#: What registries held in the parent, kept referenced in a forked child and never used:
#: destroying it there would run destructors (a CUDA stream's, say) against resources
#: that belong to the parent.
_left_behind: list[dict[Any, Any]] = []


class Registry(Generic[K, V]):
    """A dict of per-process state with its lock, emptied in a child after ``fork``.

    Parameters
    ----------
    name
        What it holds, for :func:`registries` and error messages.

    Examples
    --------
    >>> reg = Registry("example")
    >>> with reg.lock:
    ...     reg.items["a"] = 1
    >>> reg.items
    {'a': 1}
    """

    def __init__(self, name: str):
        self.name = name
        self.items: dict[K, V] = {}
        self.lock = threading.Lock()
        _registries.append(self)

    def forget(self) -> None:
        """Start empty, with a fresh lock (the old one may be held by a parent's thread
        that does not exist here); what it held is left alone (see ``_left_behind``)."""
        _left_behind.append(self.items)
        self.items = {}
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, {len(self.items)} item(s))"


def registries() -> list[Registry[Any, Any]]:
    """Every registry of per-process state made so far."""
    return list(_registries)


def _after_fork_in_child() -> None:
    for reg in _registries:
        reg.forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
