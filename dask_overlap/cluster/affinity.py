"""CPU affinity of GPU workers: the cores near a GPU, from NVML, and a plugin that keeps a
worker on them.

A GPU hangs off one CPU socket. A worker whose threads run on another socket's cores, or
whose memory lies in another NUMA node, sends every staged byte over the link between the
sockets: the copy threads' memcpy into pinned buffers, the DMA that reads them, the copy
out of them. dask-cuda pins each worker to its GPU's cores (its ``CPUAffinity`` plugin);
:class:`~dask_overlap.LocalGPUCluster` and ``dask overlap worker`` do the same when
``overlap.cpu-affinity`` is on (the default).

The cores are NVML's (``nvidia-ml-py``; asking NVML initialises no CUDA context), as in
dask-cuda's ``get_cpu_affinity``, intersected with the cores this process may already run
on, so an affinity is never widened: a worker started under ``taskset`` or in a batch
job's cgroup keeps to its share, and an empty intersection leaves it alone.

Order matters: ``staging-threads: auto`` counts the process's cores when the worker's
runtime is built (:func:`dask_overlap.pipeline.copies.auto_threads`), so the affinity must be set
before :class:`~dask_overlap.OverlapPlugin` sets up. Both callers give
:class:`CPUAffinity` to the worker when it starts, listed first: a worker sets up the
plugins it starts with before it registers with the scheduler (where LocalGPUCluster's
OverlapPlugin comes from), and starts their setups in order, each running to its first
``await``; ``CPUAffinity.setup`` has none. It sets the affinity of every thread of the
process, not only the calling one, so threads started earlier (Dask's, or a runtime's
copy threads) follow too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin

if TYPE_CHECKING:
    from distributed import Worker

__all__ = [
    "CPUAffinity",
    "gpu_cores",
    "nvml_cores",
    "process_cores",
    "restrict",
    "set_process_affinity",
    "unpack_bitmask",
]

logger = logging.getLogger(__name__)


def unpack_bitmask(masks: Iterable[int], mask_bits: int = 64) -> list[int]:
    """The CPU ids set in ``masks``, a list of ``mask_bits``-bit words, lowest word first.

    This is how NVML's ``nvmlDeviceGetCpuAffinity`` reports a GPU's cores (64-bit words),
    unpacked as dask-cuda's ``unpack_bitmask`` does.

    Examples
    --------
    >>> unpack_bitmask([1 + 2 + 8])
    [0, 1, 3]
    >>> unpack_bitmask([1 + 2 + 16, 2 + 4])
    [0, 1, 4, 65, 66]
    >>> unpack_bitmask([1 + 2 + 16, 2 + 4], mask_bits=32)
    [0, 1, 4, 33, 34]
    """
    out = []
    for i, mask in enumerate(masks):
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < 1 << mask_bits:
            raise ValueError(
                f"masks must hold {mask_bits}-bit unsigned integers, got {mask!r} at {i}"
            )
        out += [i * mask_bits + b for b in range(mask_bits) if mask >> b & 1]
    return out


def process_cores() -> set[int] | None:
    """The cores this thread may run on (``None`` where the OS does not say: not Linux)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return None


def restrict(cores: Iterable[int]) -> list[int] | None:
    """``cores`` within the cores this process may run on, sorted; ``None`` when none is.

    Never a core the process may not use already, so applying the result never widens
    an affinity. ``None`` also where the OS has no affinity (not Linux).

    Examples
    --------
    >>> import os
    >>> restrict(os.sched_getaffinity(0)) == sorted(os.sched_getaffinity(0))
    True
    >>> restrict([10**6]) is None  # no such core here
    True
    """
    allowed = process_cores()
    if allowed is None:
        return None
    return sorted(allowed.intersection(cores)) or None


def _cpu_words() -> int:
    """64-bit words of a CPU mask that covers every CPU id of this machine."""
    highest = max([(os.cpu_count() or 1) - 1, *(process_cores() or ())])
    return highest // 64 + 1


def _handle(pynvml: Any, device: str) -> Any:
    """The NVML handle of the GPU that CUDA device id ``device`` names (an index, a UUID,
    a unique UUID prefix, or a MIG instance's UUID: then its parent GPU)."""
    if device.isdigit():
        # NVML counts GPUs in PCI order, CUDA fastest first unless CUDA_DEVICE_ORDER is
        # PCI_BUS_ID: the two agree on machines whose GPUs are all alike.
        return pynvml.nvmlDeviceGetHandleByIndex(int(device))
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(device)
    except pynvml.NVMLError:
        # CUDA_VISIBLE_DEVICES also takes a unique prefix of a UUID; NVML does not.
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(device):
                found.append(h)
        if len(found) != 1:
            raise
        return found[0]
    if pynvml.nvmlDeviceIsMigDeviceHandle(handle):
        handle = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    return handle


#: Why NVML cannot say, when nvidia-ml-py is missing.
NO_NVML = (
    "nvidia-ml-py is not installed (pip install nvidia-ml-py, or dask_overlap[cuda13] / "
    "[cuda12]: NVML counts GPUs as Dask's GPU diagnostics do)"
)


@contextlib.contextmanager
def nvml() -> Iterator[Any]:
    """``pynvml``, started for the block and shut down after it, or a string that says why
    NVML cannot answer (not installed, or no driver). NVML counts its starts, so the
    shutdown leaves distributed's own (its GPU metrics, in the same process) running."""
    try:
        import pynvml
    except ImportError:
        yield NO_NVML
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        yield f"NVML did not start ({e})"
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def nvml_cores(device: str | int) -> list[int] | None:
    """The cores NVML reports near the GPU that ``device`` names, as NVML says them.

    ``device`` is a CUDA device id, as in ``CUDA_VISIBLE_DEVICES``: an index, a UUID or
    a MIG instance's UUID (the cores of its GPU). ``None`` when ``nvidia-ml-py`` is not
    installed, NVML cannot start (no driver), or it does not know the device.

    Examples
    --------
    >>> nvml_cores(0)  # doctest: +SKIP
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    """
    with nvml() as pynvml:
        if isinstance(pynvml, str):
            logger.debug("%s: no CPU affinity for GPU %s", pynvml, device)
            return None
        try:
            masks = pynvml.nvmlDeviceGetCpuAffinity(_handle(pynvml, str(device)), _cpu_words())
            return unpack_bitmask(list(masks)) or None
        except pynvml.NVMLError as e:
            logger.debug("NVML has no CPU affinity for GPU %s: %s", device, e)
            return None


def gpu_cores(device: str | int) -> list[int] | None:
    """The cores near GPU ``device`` that this process may run on; ``None`` when unknown
    or when none of them is (then the affinity is best left as it is).

    Examples
    --------
    >>> gpu_cores("0")  # doctest: +SKIP
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    near = nvml_cores(device)
    return None if near is None else restrict(near)


def set_process_affinity(cores: Iterable[int]) -> None:
    """Let every thread of this process run on ``cores`` only.

    ``os.sched_setaffinity(0, ...)`` sets the calling thread's alone (new threads inherit
    their creator's); this also sets those already running, so a worker's event loop,
    Dask's threads and a runtime's copy threads all follow. Threads that start while it
    runs are caught by going over the list again until it stops changing.
    """
    cores = set(cores)
    os.sched_setaffinity(0, cores)
    done: set[str] = set()
    for _ in range(10):
        try:
            tids = set(os.listdir("/proc/self/task")) - done
        except FileNotFoundError:  # pragma: no cover - no /proc: the calling thread only
            return
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:  # the thread has ended
                pass
        done |= tids


class CPUAffinity(WorkerPlugin):
    """Keeps a worker's process on ``cores``: those near its GPU (see :func:`gpu_cores`).

    Like dask-cuda's plugin of the same name, but the cores are checked here, on the
    client, and applied in :meth:`setup` within the worker's own affinity (never widened;
    left alone when none of ``cores`` is allowed there) to every thread of the worker.
    After setup, the worker's copy of the plugin holds ``applied`` (the cores set, or
    ``None``) and ``before`` (the affinity it replaced).

    Parameters
    ----------
    cores
        CPU ids, e.g. ``gpu_cores("0")``.

    Examples
    --------
    >>> from distributed import LocalCluster
    >>> from dask_overlap.cluster.affinity import CPUAffinity, gpu_cores
    >>> cluster = LocalCluster(plugins=[CPUAffinity(gpu_cores(0))])  # doctest: +SKIP
    """

    name = "overlap-cpu-affinity"

    def __init__(self, cores: Iterable[int]):
        cores = list(cores)
        if not cores or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cores):
            raise ValueError(f"cores must be a non-empty list of CPU ids >= 0, got {cores!r}")
        self.cores = sorted(set(cores))
        self.applied: list[int] | None = None
        self.before: set[int] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cores={self.cores!r})"

    def setup(self, worker: Worker) -> None:
        # A plugin a worker starts with is set up before the worker reaches the scheduler,
        # where an event would be dropped: what happened stays on the plugin, and in the
        # worker's log.
        self.before = process_cores()
        self.applied = restrict(self.cores)
        if self.applied is None:
            logger.warning(
                "CPU affinity left as it is: none of cores %s is among this worker's (%s)",
                self.cores,
                "no affinity on this OS" if self.before is None else sorted(self.before),
            )
            return
        try:
            set_process_affinity(self.applied)
        except OSError as e:  # a cpuset or a sandbox that refuses: leave it, do not fail
            logger.warning(
                "CPU affinity left as it is: setting cores %s failed (%s)", self.applied, e
            )
            self.applied = None
            return
        logger.info("CPU affinity: cores %s (were %s)", self.applied, sorted(self.before or ()))
