"""Where a graph's partitions will run, as the client can tell while it builds the graph.

``batch="auto"`` joins small blocks into partitions for a device's sake: a partition's
round trip of copies and its host work cost the same whatever its size, and a larger one
shares them out (:mod:`.batch`). On the host backend there is no device and no copy to
share out: a join is one more host copy of every byte, a partition of joined blocks needs
them all on one worker (a transfer for each block that lives elsewhere), and one partition
of them costs what their tasks would. So where every partition will run on the host
backend, ``batch="auto"`` keeps one partition per block (:func:`placement`, asked by
:func:`~dask_overlap.graph.map_blocks.map_blocks`).

Which backend serves a partition task is its worker's answer
(:func:`~dask_overlap.pipeline.current.runtime_backend`: the worker plugin's backend,
else ``overlap.backend`` resolved there). The client learns it

- with a default distributed client (the ``scheduler`` that ``Client`` sets in
  ``dask.config``): from each worker's heartbeat entry, which the
  :class:`~dask_overlap.OverlapPlugin` fills (``metrics["overlap"]["backend"]`` in
  ``Client.scheduler_info()``; see :mod:`dask_overlap.metrics.worker`); a worker that has
  none (no plugin, or the heartbeat since its plugin's setup has not arrived yet) is
  asked with ``Client.run``;
- with the threaded, synchronous or multiprocessing scheduler: in this process, whose
  machine runs the tasks;
- otherwise (an asynchronous client, a client not set as default, a cluster with no
  workers yet, a worker that does not answer): it is not known, and ``auto`` does what
  it does for a device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import dask

from ..backends.host import HostBackend
from ..pipeline.current import runtime_backend

__all__ = ["HOST", "Placement", "distributed_workers", "placement"]

#: The backend whose device memory is host memory (``Backend.host_memory``): no device.
HOST = HostBackend.name
#: ``dask.config``'s ``scheduler`` values that run tasks in this process or its children.
_LOCAL_SCHEDULERS = frozenset(
    {"threads", "threading", "sync", "synchronous", "single-threaded", "processes",
     "multiprocessing"}
)  # fmt: skip
_DISTRIBUTED = frozenset({"dask.distributed", "distributed"})


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a graph's partitions will run.

    ``backends``: the backends their runtimes resolve to (empty where that is not
    known); ``workers``: the distributed workers' entries of ``scheduler_info()``, by
    address (``None`` where the graph will not run on a distributed client).
    """

    backends: frozenset[str]
    workers: dict[str, dict[str, Any]] | None = None

    @property
    def on_host(self) -> bool:
        """Whether every partition will run on the host backend (no device anywhere).

        Examples
        --------
        >>> Placement(frozenset({"host"})).on_host, Placement(frozenset()).on_host
        (True, False)
        >>> Placement(frozenset({"host", "cuda"})).on_host
        False
        """
        return self.backends == {HOST}


def distributed_workers() -> dict[str, dict[str, Any]] | None:
    """The workers (their ``scheduler_info()`` entries, by address) of the default client
    that a graph built now will run on; ``None`` where there is none to ask: the
    scheduler is not distributed, no client is the default, or it is asynchronous (whose
    cached identity lists no workers)."""
    if dask.config.get("scheduler", None) not in _DISTRIBUTED:
        return None
    from distributed import default_client  # imported already: a client exists

    try:
        client = default_client()
    except ValueError:
        return None
    if client.asynchronous or client.status != "running":
        return None
    return dict(client.scheduler_info().get("workers") or {})


def placement(backend: str) -> Placement:
    """Where partition tasks of ``backend`` (``overlap.backend`` as the client resolved
    its options: a backend's name, or ``auto``) will run: see the module docstring."""
    workers = distributed_workers()
    if backend != "auto":  # a backend named runs as that backend wherever it runs
        return Placement(frozenset({backend}), workers)
    if workers is not None:
        return Placement(_workers_backends(workers), workers)
    if dask.config.get("scheduler", None) in _LOCAL_SCHEDULERS | {None}:
        return Placement(frozenset({runtime_backend(backend)}))
    return Placement(frozenset())  # a scheduler of some other kind: not known


def _workers_backends(workers: dict[str, dict[str, Any]]) -> frozenset[str]:
    """The backends ``auto`` partitions resolve to on ``workers``: from their heartbeats,
    else asked (empty when any does not say)."""
    from ..metrics.worker import METRICS_NAME  # (distributed's: a client exists)

    found: set[str] = set()
    unsaid = []
    for address, w in workers.items():
        entry = (w.get("metrics") or {}).get(METRICS_NAME) or {}
        if entry.get("backend"):
            found.add(entry["backend"])
        else:
            unsaid.append(address)
    if unsaid:
        answers = _ask(unsaid)
        if answers is None or not all(isinstance(a, str) for a in answers.values()):
            return frozenset()
        found.update(answers.values())
    return frozenset(found) if workers else frozenset()


def _ask(addresses: list[Any]) -> dict[str, Any] | None:
    """Each worker's :func:`~dask_overlap.pipeline.current.runtime_backend` of ``auto``
    (an exception where one failed); ``None`` where they could not be asked."""
    from distributed import default_client

    try:
        return default_client().run(runtime_backend, "auto", workers=addresses, on_error="return")
    except Exception:  # a worker gone meanwhile, a closing client: not known
        return None
