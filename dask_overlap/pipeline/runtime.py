"""The runtime: one per process and backend, owner of every pool.

It owns the backend (and through it the pinned and device pools), the stream pool, the
copy threads (staging in, unstaging out) and the counters. Partition tasks share it, so
the bounds of its pools hold for the whole process however many partitions run at once.
It is created on first use (nothing touches a GPU before a task runs) and closed by
:func:`close_runtimes`, at interpreter exit, or by the worker plugin's teardown.

This module knows neither the partition runner nor the worker plugin: they use it.
:func:`process_runtime` is the per-process runtime of a backend; which runtime serves a
task (a worker plugin's, or this one) is :mod:`dask_overlap.pipeline.current`'s question.
"""

from __future__ import annotations

import atexit
import collections
import copy
import dataclasses
import functools
import gc
import logging
import sys
import threading
import time
import warnings
from typing import Any, NamedTuple

import dask.config

from ..backends import Backend, HostPool, Stream, make_backend, resolve_backend
from ..config import Options
from ..process import Registry
from .copies import Copier, auto_threads
from .recycle import ResultPool, result_pool_bytes
from .sampling import StageSampler
from .stats import Counters

__all__ = [
    "DIRECT_BYTES_AUTO",
    "EVERY_SUB_CHUNK",
    "Runtime",
    "Span",
    "close_runtimes",
    "freeze_heap_once",
    "idle_stats",
    "process_runtime",
    "process_runtimes",
    "resolve_direct_bytes",
]

logger = logging.getLogger(__name__)
TIMELINE_LENGTH = 20_000
HOST_STAGES = ("staging", "unstaging")  # run by the copy threads, not on a stream
#: How long closing a runtime waits for partitions still running on it (a worker closes its
#: plugins before its executor, and a pool must not be released under a copy).
DRAIN_SECONDS = 30.0
#: How often the runtime looks whether it is idle, to give the backend's cached device
#: memory back (see Runtime._trim_when_idle).
TRIM_SECONDS = 0.5
#: How long the runtime stays idle, and its result pool gets no buffer back, before the
#: pool's idle buffers are freed: long enough for work that follows work (a job after a
#: job, a run after a check of the last), short enough that a worker Dask paused for its
#: memory gets it back.
RESULTS_IDLE_SECONDS = 5.0


#: ``direct-bytes: auto`` where the device has memory of its own.
DIRECT_BYTES_AUTO = 1 << 20
#: ``direct-bytes: auto`` where the device's memory is host memory: every sub-chunk.
EVERY_SUB_CHUNK = -1


def resolve_direct_bytes(direct_bytes: int | str, host_memory: bool) -> int:
    """The ``direct-bytes`` a runtime applies: a number of bytes, or
    :data:`EVERY_SUB_CHUNK` (``auto`` on a backend whose device memory is host memory,
    where the ring's copies would serve no device).

    Examples
    --------
    >>> resolve_direct_bytes("auto", host_memory=False) == DIRECT_BYTES_AUTO
    True
    >>> resolve_direct_bytes("auto", host_memory=True) == EVERY_SUB_CHUNK
    True
    >>> resolve_direct_bytes(0, host_memory=True)
    0
    """
    if direct_bytes != "auto":
        return int(direct_bytes)
    return EVERY_SUB_CHUNK if host_memory else DIRECT_BYTES_AUTO


class Span(NamedTuple):
    """One stage of one sub-chunk as it ran: ``start``/``end`` in ``time.time()`` seconds."""

    key: tuple
    sub_chunk: int
    stream: int  # index in the runtime's stream pool; -1 for the copy threads
    stage: str
    start: float
    end: float
    nbytes: int


#: ``Span(*fields)`` from a tuple of them, made in C: the namedtuple's own ``__new__`` is
#: a Python function, and every partition records a span per stage.
_span = functools.partial(tuple.__new__, Span)


_frozen = threading.Lock()  # held for good once the heap has been frozen


def freeze_heap_once() -> bool:
    """``gc.freeze()``, once per process (``overlap.freeze-heap``); whether this call did.

    The cyclic collector's full passes walk every tracked object while holding the GIL,
    so they stop every thread that feeds the GPU: on an H100 one pass took 33 ms, in the
    middle of a 0.13 s run of the pinned path (0.71 of the bound against 0.88-0.90 for
    the runs without one; with the heap frozen, none in eight runs). When a runtime is
    built the process has imported what it needs, and what is alive then mostly lives as
    long as the process (its modules): frozen, it is left out of every pass.
    Objects made later are collected as before. A process that runs a distributed
    scheduler or worker is left as it is: their comms and coroutines die in reference
    cycles that a frozen heap keeps alive (a cluster's scheduler then logged a cancelled
    feed at close).
    """
    # distributed has no public "is a scheduler or worker running here": its classes'
    # weak sets of live instances (empty when a later version drops them: we freeze).
    # A module another thread is importing now has no such class yet: as one that may
    # start, not frozen (this call; a later runtime may).
    for module, name in (("distributed.scheduler", "Scheduler"), ("distributed.worker", "Worker")):
        loaded = sys.modules.get(module)
        if loaded is None:
            continue
        cls = getattr(loaded, name, None)
        if cls is None or len(getattr(cls, "_instances", ())):
            return False
    if not _frozen.acquire(blocking=False):
        return False
    gc.freeze()
    logger.debug("froze %d objects out of the collector's passes", gc.get_freeze_count())
    return True


class Runtime:
    """Pools and threads for one device; see the module docstring.

    Parameters
    ----------
    options
        Resolved options; ``Options.from_config()`` when omitted.
    memory_limit
        The memory limit of the distributed worker the runtime serves, if any: what
        ``result-pool-size: auto`` takes a share of (the machine's memory otherwise).
    """

    def __init__(self, options: Options | None = None, memory_limit: int | None = None):
        self.options = options if options is not None else Options.from_config()
        self.backend: Backend = make_backend(self.options)
        self.name = self.backend.name
        self.streams: list[Stream] = []
        try:
            self._build(memory_limit)
        except BaseException:
            self._abandon()  # what it started (threads, streams, pools) goes with it
            raise

    def _build(self, memory_limit: int | None) -> None:
        for _ in range(self.options.streams):
            self.streams.append(self.backend.make_stream())
        threads = self.options.staging_threads
        self.copy_threads = auto_threads() if threads == "auto" else int(threads)
        self.copies = Copier(self.copy_threads, f"overlap-{self.name}-copy")
        # Pageable buffers that out="host" results are made in, used again once Dask lets
        # a result go (overlap.result-pool-size; 0: none kept).
        self.results = ResultPool(result_pool_bytes(self.options.result_pool_size, memory_limit))
        self.counters = Counters()
        # overlap.direct-bytes as this backend applies it (see resolve_direct_bytes)
        host_memory = self.backend.host_memory
        self.direct_bytes = resolve_direct_bytes(self.options.direct_bytes, host_memory)
        # Sub-chunks currently holding each stream: a stream is in-order, so a sub-chunk
        # queued behind another's copy waits even when its own engine is idle. Leasing the
        # least-loaded stream keeps that head-of-line blocking to when every stream is busy.
        self._leases = [0] * len(self.streams)
        self._index = {id(s): j for j, s in enumerate(self.streams)}
        self._turn = 0
        self._lock = threading.Lock()
        self.closed = False
        # The overlap.* settings it was built from (see process_runtime), and whether a
        # change of them while it was busy has been warned about.
        self.settings: dict[str, Any] = {}
        self.warned = False
        # The most recent stage spans, newest last: the assembly line as it ran.
        self.timeline: collections.deque[Span] = collections.deque(maxlen=TIMELINE_LENGTH)
        # Which small partitions the lean path times on the device (None: all of them).
        self.sampler = StageSampler() if self.backend.sampled_timing else None
        self._stopped = threading.Event()
        self._trimmer = threading.Thread(
            target=self._trim_when_idle, name=f"overlap-{self.name}-trim", daemon=True
        )
        self._trimmer.start()
        if self.options.freeze_heap:
            freeze_heap_once()

    def _abandon(self) -> None:
        """Stop what a construction that failed had started, as :meth:`close` would."""
        stopped, trimmer = getattr(self, "_stopped", None), getattr(self, "_trimmer", None)
        if stopped is not None:
            stopped.set()
        if trimmer is not None and trimmer.is_alive():
            trimmer.join()
        for part in (getattr(self, "copies", None), getattr(self, "results", None)):
            if part is not None:
                part.close()
        for s in self.streams:
            s.close()
        self.backend.close()

    def _trim_when_idle(self) -> None:
        """Every TRIM_SECONDS, when no partition runs and none has started since the last
        look, the backend's cached device memory goes back to its pool (``Backend.trim``):
        the cache serves partitions that follow each other closely, and holds nothing for
        long once they stop (blocks a failed partition's traceback kept come back to it
        when collected, and go back from there at the next look). Once it has been idle
        for RESULTS_IDLE_SECONDS, and its result pool got no buffer back for as long, the
        pool's idle buffers are freed too."""
        seen, idle_since = -1, None
        while not self._stopped.wait(TRIM_SECONDS):
            counters = self.counters
            started = counters.partitions
            if started == seen and counters.partitions_active == 0:
                try:
                    self.backend.trim()
                except Exception:  # a broken device: the partitions will say so too
                    logger.exception(
                        "%s runtime: giving cached device memory back failed", self.name
                    )
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                # buffers given back a moment ago are kept for the work that may follow
                quiet = now - max(idle_since, self.results.returned_at)
                if self.results.idle_bytes and quiet >= RESULTS_IDLE_SECONDS:
                    self.results.clear()  # idle buffers held for long serve no one
            else:
                idle_since = None
            seen = started

    def acquire_stream(self) -> Stream:
        """Lease the least-loaded stream of the pool (ties go round-robin)."""
        with self._lock:
            leases, n = self._leases, len(self.streams)
            start = self._turn = (self._turn + 1) % n
            if leases[start] == 0:  # the usual case, looked up without a scan
                best = start
            else:
                best = min(range(start, start + n), key=lambda j: leases[j % n]) % n
            leases[best] += 1
            return self.streams[best]

    def release_stream(self, stream: Stream) -> None:
        """End a lease taken with :meth:`acquire_stream`."""
        with self._lock:
            self._leases[self._index[id(stream)]] -= 1

    def record_spans(
        self,
        key: tuple,
        sub: int,
        stream: Stream | None,
        spans: list[tuple[str, float, float, int]],
    ) -> None:
        """Keep one sub-chunk's stage spans (stage, start, end, bytes; ``time.time()``) on
        the timeline. (Their busy seconds reach the counters with the partition's tallies.)"""
        j = self._index.get(id(stream), -1)  # its place in the pool; -1: none
        append = self.timeline.append
        for stage, start, end, nbytes in spans:
            append(_span((key, sub, -1 if stage in HOST_STAGES else j, stage, start, end, nbytes)))

    def stats(self) -> dict[str, Any]:
        """Counters plus the pools' current occupancy (see :func:`runtime_stats`)."""
        return _stats(
            self.counters,
            self.name,
            self.backend.pinned,
            self.backend.device_bytes_in_use(),
            len(self.streams),
            self.copy_threads,
            self.results,
        )

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Wait, up to ``timeout`` seconds, until no partition runs on this runtime; whether
        none does."""
        deadline = time.monotonic() + timeout
        while self.counters.partitions_active and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.counters.partitions_active

    def close(self, timeout: float = DRAIN_SECONDS) -> None:
        """Stop the threads and release the pools, once running partitions are done. Idempotent.

        A partition still running (a task Dask left behind when another one failed, or was
        interrupted) holds streams and pool blocks and waits for its streams' completions:
        streams stopped under it would leave it, and its thread, waiting forever. So this
        waits, up to ``timeout`` seconds, until none is active; new partitions already go
        to a fresh runtime, since this one is marked closed first.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.counters.refuse()  # a task that got it just before starts on another
        self.drain(timeout)
        self._stopped.set()
        self._trimmer.join()
        self.copies.close()
        self.results.close()
        for s in self.streams:
            s.close()
        self.backend.close()


# This process's own runtimes (the threaded and synchronous schedulers'), by backend.
_runtimes: Registry[str, Runtime] = Registry("runtimes of this process, by backend")


def _settings() -> dict[str, Any]:
    """The ``overlap`` settings as they are now (compared, not read, on every task)."""
    return dask.config.config.get("overlap") or {}


def process_runtime(backend: str) -> Runtime:
    """This process's own runtime for ``backend`` (resolved, not ``auto``), made on first use.

    Settings changed since it was built (``overlap.*``: pool sizes, streams, threads) are
    applied by building it again once no partition runs on it; until then a warning names
    them, once.
    """
    name = resolve_backend(backend)
    settings = _settings()
    # Asked by every partition task: the usual answer without the lock (a runtime closed
    # just after this read is one closed just after the locked read would have returned).
    rt = _runtimes.items.get(name)
    if rt is not None and not rt.closed and rt.settings == settings:
        return rt
    with _runtimes.lock:
        rt = _runtimes.items.get(name)
        if rt is not None and not rt.closed and rt.settings != settings:
            rt = _settle(rt, settings)
        if rt is None or rt.closed:
            rt = _runtimes.items[name] = Runtime(Options.from_config(backend=name))
            rt.settings = copy.deepcopy(settings)
        return rt


#: Options a runtime is not built of, so that a change of them updates it in place:
#: ``in_flight``, ``sub_chunk_bytes`` and ``fuse`` are read when a graph is built,
#: ``stall_timeout`` and ``pinned_serialize`` as each partition or array goes,
#: ``cpu_affinity`` when a worker starts, ``freeze_heap`` when a runtime is built. (A
#: ``dask.config.set`` of the window around one call rebuilt the pools and streams.)
READ_AS_IT_GOES = frozenset(
    {"in_flight", "sub_chunk_bytes", "fuse", "stall_timeout", "pinned_serialize"}
    | {"cpu_affinity", "freeze_heap"}
)


def _settle(rt: Runtime, settings: dict[str, Any]) -> Runtime | None:
    """``rt``, or ``None`` (closed, to be built again) when the settings changed what it
    is and no partition runs on it."""
    options = Options.from_config(backend=rt.name)
    changed = [
        f"overlap.{f.name.replace('_', '-')} ({getattr(rt.options, f.name)!r} -> "
        f"{getattr(options, f.name)!r})"
        for f in dataclasses.fields(Options)
        if f.name != "backend"
        and f.name not in READ_AS_IT_GOES
        and getattr(options, f.name) != getattr(rt.options, f.name)
    ]
    if not changed:
        rt.options = options
        rt.settings = copy.deepcopy(settings)
        return rt
    if rt.counters.retire():  # none runs, and from now on none may start on it
        rt.close()
        return None
    if not rt.warned:
        rt.warned = True
        warnings.warn(
            f"{', '.join(changed)} changed after this process's {rt.name} runtime was built, "
            "while partitions run on it: they apply once none does (the runtime is built "
            "again then)",
            RuntimeWarning,
            stacklevel=4,
        )
    return rt


def process_runtimes() -> dict[str, Runtime]:
    """This process's own runtimes that exist now, by backend name."""
    with _runtimes.lock:
        return dict(_runtimes.items)


def _stats(
    counters: Counters,
    backend: str,
    pool: Any,
    device: int | None,
    streams: int,
    staging_threads: int | str,
    results: ResultPool,
) -> dict[str, Any]:
    """What :func:`runtime_stats` returns, of a runtime's parts (the one place its keys
    are written)."""
    out = counters.snapshot()
    out.update(
        backend=backend,
        pinned_bytes_in_use=pool.in_use,
        pinned_bytes_held=pool.held,
        pinned_bytes_peak=pool.peak,
        pinned_pool_size=pool.limit,
        ring_waits=pool.waits,
        pinned_refused=pool.refused,
        device_bytes_in_use=out["device_bytes_in_flight"] if device is None else device,
        streams=streams,
        staging_threads=staging_threads,
        result_bytes_idle=results.idle_bytes,
        result_pool_size=results.capacity,
        results_reused=results.reused,
        results_fresh=results.fresh,
    )
    return out


def idle_stats(backend: str) -> dict[str, Any]:
    """What :meth:`Runtime.stats` says of a runtime of ``backend`` that has done nothing
    yet, built from the configuration (the same keys)."""
    options = Options.from_config(backend=backend)
    return _stats(
        Counters(),
        backend,
        HostPool(options.pinned_pool_size),
        0,
        options.streams,
        options.staging_threads,
        ResultPool(result_pool_bytes(options.result_pool_size)),
    )


@atexit.register
def close_runtimes() -> None:
    """Close every runtime of this process."""
    with _runtimes.lock:
        rts = list(_runtimes.items.values())
        _runtimes.items.clear()
    for rt in rts:
        rt.close()
