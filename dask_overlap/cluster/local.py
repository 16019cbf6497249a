"""One worker per GPU: :class:`LocalGPUCluster`, and the worker layout it shares with the CLI.

Each worker is its own process with its own ``CUDA_VISIBLE_DEVICES``, rotated so that
worker *i* sees GPU *i* first (as dask-cuda does), kept to the cores near its GPU
(:class:`~dask_overlap.cluster.affinity.CPUAffinity`, when ``overlap.cpu-affinity``), and carries
an :class:`~dask_overlap.OverlapPlugin` that builds its runtime. Workers talk over
``protocol`` (``tcp`` by default; ``ucxx`` for UCX, with the transports
:mod:`dask_overlap.cluster.ucx` sets).

GPUs are counted without initialising CUDA in this process: from ``CUDA_VISIBLE_DEVICES``
when set, else through NVML (``nvidia-ml-py``, as distributed's GPU diagnostics and
dask-cuda do). Without ``nvidia-ml-py``, or when NVML cannot start, as before it: the
GPUs ``nvidia-smi -L`` lists, else CuPy's count in a subprocess.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from numbers import Integral
from typing import Any

import dask.config
from distributed import LocalCluster, WorkerPlugin
from distributed.protocol.pickle import dumps
from distributed.worker_memory import parse_memory_limit

from ..config import Options, check_positive_int
from ..dashboard import OverlapSchedulerPlugin
from .affinity import CPUAffinity, gpu_cores, nvml, process_cores
from .plugin import OverlapPlugin, resolve_options
from .ucx import UCXSettings, check_protocol, is_ucx, require_ucx, scheme_of, ucx_settings

__all__ = [
    "CPU_WORKERS",
    "THREADS_PER_WORKER",
    "LocalGPUCluster",
    "WorkerLayout",
    "plan_workers",
    "visible_gpus",
    "worker_memory_limit",
]

# Threads of a GPU worker: the partitions in flight on its GPU. Measured on an H200
# (benchmarks/results/REPORT-cuda.md): across partitions alone, 4 threads ran 1.99x one
# thread's rate and 2 threads 1.58x; the tuned cases reached 0.85-0.92 of the PCIe bound
# at 4, and more than 4 rarely helped; the demo ran 13.0 / 13.2 / 13.8 GB/s at 2 / 4 / 8.
# sub-chunk-bytes: auto also assumes about four partitions in flight.
THREADS_PER_WORKER = 4

# Workers of a CPU-path cluster (allow_cpu=True on a machine with no GPU). They share the
# cores this process may use, as distributed.LocalCluster's workers do (see
# WorkerLayout.threads_per_worker): there the partitions in flight are work for the cores.
CPU_WORKERS = 2

logger = logging.getLogger(__name__)

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options))
_NO_GPU = "no GPU is visible (CUDA_VISIBLE_DEVICES is {cvd}{probe})"
_FOR_CPU = "; pass allow_cpu=True (--allow-cpu) for CPU workers on the host backend"


def parse_devices(value: str | int | Sequence[str | int]) -> list[str]:
    """Device ids from a ``CUDA_VISIBLE_DEVICES`` string (or one index, or a sequence of ids).

    As CUDA does, the list ends at the first ``-1``; ids may be indices or UUIDs.

    Examples
    --------
    >>> parse_devices("0, 2,1")
    ['0', '2', '1']
    >>> parse_devices(1)
    ['1']
    >>> parse_devices("-1")
    []
    """
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, Integral) and not isinstance(value, bool):
        items = [str(value)]
    elif isinstance(value, Sequence):
        items = [str(v) for v in value]
    else:
        raise TypeError(
            "cuda_visible_devices must be a CUDA_VISIBLE_DEVICES string such as '0,1', "
            f"a device index or a sequence of ids; got {value!r}"
        )
    out = []
    for item in (s.strip() for s in items):
        if not item or item == "-1":
            break
        out.append(item)
    return out


def worker_memory_limit(
    value: str | float | None, n_workers: int, *, name: str = "memory_limit"
) -> int | None:
    """Each of ``n_workers`` workers' memory limit in bytes (``None``: no limit), read as
    distributed reads it (``"auto"`` shares this machine's memory among the workers, a
    number at most 1 is a fraction of it, 0 or ``None`` is no limit), or a ValueError
    that names ``name``.

    Examples
    --------
    >>> worker_memory_limit("4GiB", 2)
    4294967296
    >>> worker_memory_limit("-1GiB", 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: memory_limit must be 'auto', a byte count such as '32GiB', ...; got '-1GiB'
    """
    expected = ValueError(
        f"{name} must be 'auto', a byte count such as '32GiB', a fraction of this "
        f"machine's memory (at most 1) or 0 for none; got {value!r}"
    )
    if isinstance(value, bool):
        raise expected
    try:
        limit = parse_memory_limit(value, 1, n_workers, logger=logger)
    except (ValueError, TypeError):
        raise expected from None
    if limit is not None and limit < 0:
        raise expected
    return limit


def _parse_nvidia_smi(text: str) -> list[str]:
    # "GPU 0: NVIDIA H200 (UUID: GPU-...)"; MIG instances are indented and not counted.
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", text, re.MULTILINE)]


def _nvml_gpus() -> list[str] | str:
    """Indices of the GPUs NVML reports, or why NVML could not say (not installed, or
    no driver). MIG instances are not counted (their GPU is): name them in
    CUDA_VISIBLE_DEVICES."""
    with nvml() as pynvml:
        if isinstance(pynvml, str):
            return pynvml
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as e:
            return f"NVML could not count the GPUs ({e})"


def _probe_gpus() -> tuple[list[str], str]:
    """The GPUs this machine shows, and what was asked, for an error that finds none."""
    found = _nvml_gpus()
    if not isinstance(found, str):
        return found, "NVML reports no device"
    asked = f"{found}, and neither nvidia-smi nor CuPy reports a device"
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return _parse_nvidia_smi(out), asked
    except (OSError, subprocess.SubprocessError):
        pass
    if importlib.util.find_spec("cupy") is None:
        return [], asked
    code = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        ).stdout
        return [str(i) for i in range(int(out.strip().splitlines()[-1]))], asked
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return [], asked


def visible_gpus() -> list[str]:
    """Ids of the GPUs this machine shows, found without initialising CUDA here.

    ``CUDA_VISIBLE_DEVICES`` when set, else the GPUs NVML counts (``nvidia-ml-py``);
    without it, the GPUs ``nvidia-smi -L`` lists, else the count CuPy reports in a
    subprocess. ``[]`` when none of them finds a device.

    Examples
    --------
    >>> import os
    >>> os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    >>> visible_gpus()
    ['0', '1']
    >>> del os.environ["CUDA_VISIBLE_DEVICES"]
    """
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return parse_devices(os.environ["CUDA_VISIBLE_DEVICES"])
    return _probe_gpus()[0]


def _no_gpu(cvd: str, asked: str | None) -> str:
    """Why there is no GPU: ``cvd`` says what CUDA_VISIBLE_DEVICES was, ``asked`` what
    else was asked (``None``: nothing, the devices were given)."""
    return _NO_GPU.format(cvd=cvd, probe="" if asked is None else f"; {asked}")


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """How many workers to start, which GPUs each sees, the options of their plugin, and
    the protocol they talk over.

    Built by :func:`plan_workers`. ``devices`` is empty for a CPU-path layout;
    ``protocol`` is ``None`` for distributed's default; ``ucx`` holds UCX's transports
    when the protocol is UCX.
    """

    n_workers: int
    devices: tuple[str, ...]
    options: Options
    protocol: str | None = None
    ucx: UCXSettings | None = None

    def env(self, i: int) -> dict[str, str]:
        """Environment of worker ``i``: its GPU first, then the others in turn; with UCX,
        its transports (``UCX_TLS``, see :mod:`dask_overlap.cluster.ucx`).

        Workers beyond the number of GPUs share them in turn (``i`` modulo the count).

        Examples
        --------
        >>> layout = WorkerLayout(3, ("0", "1", "2"), Options.from_config())
        >>> layout.env(1)
        {'CUDA_VISIBLE_DEVICES': '1,2,0'}
        """
        env = {} if self.ucx is None else self.ucx.env()
        if not self.devices:
            return env
        k = i % len(self.devices)
        rotated = self.devices[k:] + self.devices[:k]
        # A device listed twice (two workers on one GPU) must not repeat in one list.
        return {"CUDA_VISIBLE_DEVICES": ",".join(dict.fromkeys(rotated)), **env}

    @property
    def threads_per_worker(self) -> int:
        """The default threads of each worker: ``THREADS_PER_WORKER`` (partitions in flight
        per GPU) on GPUs; on the CPU path, the cores this process may use shared among
        the workers, at least one each.

        Examples
        --------
        >>> WorkerLayout(1, ("0",), Options.from_config()).threads_per_worker
        4
        """
        if self.devices:
            return THREADS_PER_WORKER
        cores = process_cores()
        return max(1, (len(cores) if cores else os.cpu_count() or 1) // self.n_workers)

    def worker_config(self) -> dict[str, Any]:
        """``dask.config`` settings each worker process starts with (UCX's, or none)."""
        return {} if self.ucx is None else self.ucx.worker_config()

    @contextmanager
    def comm_config(self) -> Iterator[None]:
        """Hold UCX's settings in this process's ``dask.config`` while the scheduler, a
        client or nannies start here (UCX starts once per process, with the first); a
        no-op for other protocols."""
        with dask.config.set(self.ucx.config() if self.ucx is not None else {}):
            yield

    def plugins(self, i: int) -> list[WorkerPlugin]:
        """Plugins worker ``i`` starts with, to set up before its runtime is built.

        :class:`~dask_overlap.cluster.affinity.CPUAffinity` to the cores near its GPU when
        ``options.cpu_affinity`` is on and NVML knows them; none on the CPU path, with
        the option off, or without NVML (the affinity is then left as it is).

        Examples
        --------
        >>> WorkerLayout(2, (), Options.from_config()).plugins(0)
        []
        """
        if not self.devices or not self.options.cpu_affinity:
            return []
        device = self.devices[i % len(self.devices)]
        cores = gpu_cores(device)
        if cores is None:
            logger.info("worker %d: CPU affinity left as it is (NVML: no cores for %s)", i, device)
            return []
        return [CPUAffinity(cores)]


def plan_workers(
    n_workers: int | None = None,
    *,
    cuda_visible_devices: str | int | Sequence[str | int] | None = None,
    allow_cpu: bool = False,
    options: Options | None = None,
    protocol: str | None = None,
) -> WorkerLayout:
    """Decide the workers of this machine: one per GPU, or CPU workers when allowed.

    Parameters
    ----------
    n_workers
        Workers to start; default one per GPU (``CPU_WORKERS`` on the CPU path). More
        workers than GPUs share them in turn.
    cuda_visible_devices
        GPUs to use (a ``CUDA_VISIBLE_DEVICES`` string or a sequence of ids); default
        :func:`visible_gpus`.
    allow_cpu
        With no GPU, plan CPU workers on the host backend instead of raising.
    options
        Options of the workers' plugin. With GPUs, ``backend="auto"`` becomes ``"cuda"``;
        on the CPU path it becomes ``"host"``.
    protocol
        What the workers talk over (see :mod:`dask_overlap.cluster.ucx`), checked first: a
        protocol no worker process can use raises ValueError, and UCX without
        ``distributed-ucxx`` an ImportError that says what to install.

    Examples
    --------
    >>> layout = plan_workers(cuda_visible_devices="", allow_cpu=True)
    >>> layout.n_workers, layout.options.backend
    (2, 'host')
    """
    protocol = check_protocol(protocol)
    if is_ucx(protocol):
        require_ucx(f"protocol={protocol!r}")
    options = resolve_options(options)
    if n_workers is not None:
        n_workers = check_positive_int("n_workers", n_workers)
    asked = None
    if cuda_visible_devices is not None:
        devices = parse_devices(cuda_visible_devices)
        cvd = f"given as {cuda_visible_devices!r}"
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        devices = parse_devices(os.environ["CUDA_VISIBLE_DEVICES"])
        cvd = repr(os.environ["CUDA_VISIBLE_DEVICES"])
    else:
        devices, asked = _probe_gpus()
        cvd = "unset"
    if devices:
        if options.backend == "auto":
            options = dataclasses.replace(options, backend="cuda")
        if options.backend == "cuda" and importlib.util.find_spec("cupy") is None:
            raise ImportError(
                f"found {len(devices)} GPU(s) but CuPy is not installed: "
                "pip install 'dask_overlap[cuda13]' (or [cuda12])"
            )
        ucx = ucx_settings(gpu=True) if is_ucx(protocol) else None
        return WorkerLayout(n_workers or len(devices), tuple(devices), options, protocol, ucx)
    if not allow_cpu:
        raise RuntimeError(_no_gpu(cvd, asked) + _FOR_CPU)
    if options.backend == "cuda":
        raise ValueError(  # allow_cpu was given: the backend is what stands in the way
            f"backend='cuda' was asked for, but {_no_gpu(cvd, asked)}; leave the backend "
            "to 'auto' (or 'host') for CPU workers"
        )
    if options.backend == "auto":
        options = dataclasses.replace(options, backend="host")
    ucx = ucx_settings(gpu=False) if is_ucx(protocol) else None
    return WorkerLayout(n_workers or CPU_WORKERS, (), options, protocol, ucx)


class LocalGPUCluster(LocalCluster):
    """A :class:`distributed.LocalCluster` with one worker process per GPU, each with the plugin.

    Worker *i* sees GPU *i* first in its ``CUDA_VISIBLE_DEVICES``, keeps to the cores near
    it (``overlap.cpu-affinity``, ``cpu_affinity=False`` to leave the affinity alone; see
    :mod:`dask_overlap.cluster.affinity`) and runs
    ``threads_per_worker`` partitions at once, all sharing its runtime (built by an
    :class:`~dask_overlap.OverlapPlugin` registered with the scheduler, so workers added
    later by ``scale`` get it too, and ``client.unregister_worker_plugin`` removes it).
    On a machine with no GPU it raises, unless ``allow_cpu=True``: then it starts
    ``CPU_WORKERS`` workers on the host backend.

    Parameters
    ----------
    n_workers
        Default one per GPU; more than the GPUs share them in turn (two workers on one GPU
        exercise the multi-worker path on one card).
    threads_per_worker
        Partitions in flight per worker: default ``THREADS_PER_WORKER`` (4) on GPUs; on
        the CPU path, this machine's cores shared among the workers (see
        :attr:`WorkerLayout.threads_per_worker`).
    cuda_visible_devices
        GPUs to use; default those this machine shows (see :func:`visible_gpus`).
    allow_cpu
        On a machine with no GPU, start CPU workers on the host backend.
    options
        Options of the workers' runtimes; ``Options.from_config()`` when omitted.
    memory_limit
        Per worker; ``"auto"`` shares this machine's memory among the workers.
    protocol
        What the scheduler, the workers and clients talk over: ``"tcp"`` (distributed's
        default), ``"ucxx"`` (or ``"ucx"``) for UCX, which needs the ``ucx-cuda13`` or
        ``ucx-cuda12`` extra (``distributed-ucxx``) and sets UCX's transports as
        :mod:`dask_overlap.cluster.ucx` says, or ``"tls"``, ``"ws"``, ``"wss"``. Checked before
        anything starts.
    **kwargs
        Option overrides (the fields of :class:`~dask_overlap.Options`, e.g.
        ``in_flight=2``), then anything :class:`distributed.LocalCluster` accepts.

    Examples
    --------
    >>> from dask_overlap import LocalGPUCluster
    >>> from distributed import Client
    >>> cluster = LocalGPUCluster()  # doctest: +SKIP
    >>> client = Client(cluster)  # doctest: +SKIP
    """

    def __init__(
        self,
        n_workers: int | None = None,
        threads_per_worker: int | None = None,
        *,
        cuda_visible_devices: str | int | Sequence[str | int] | None = None,
        allow_cpu: bool = False,
        options: Options | None = None,
        memory_limit: str | float | int | None = "auto",
        protocol: str | None = None,
        **kwargs: Any,
    ):
        if "processes" in kwargs and not kwargs.pop("processes"):
            raise ValueError("LocalGPUCluster runs one process per worker; processes=False")
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTION_NAMES}
        self.layout = plan_workers(
            n_workers,
            cuda_visible_devices=cuda_visible_devices,
            allow_cpu=allow_cpu,
            options=resolve_options(options, **overrides),
            # As LocalCluster does, a host given as an address brings its scheme.
            protocol=protocol if protocol is not None else scheme_of(kwargs.get("host")),
        )
        # Registered with the scheduler once it starts (see _start), as a client's
        # register_plugin would: every worker, including those added later by scale, gets
        # it when it joins, and client.unregister_worker_plugin tears it down.
        self.plugin = OverlapPlugin(self.layout.options)
        # The scheduler's /overlap dashboard page (see dask_overlap.dashboard).
        scheduler_kwargs = dict(kwargs.pop("scheduler_kwargs", None) or {})
        dashboard_plugin = OverlapSchedulerPlugin()
        scheduler_kwargs["plugins"] = [*scheduler_kwargs.get("plugins", ()), dashboard_plugin]
        threads = (
            self.layout.threads_per_worker
            if threads_per_worker is None
            else check_positive_int("threads_per_worker", threads_per_worker)
        )
        memory_limit = worker_memory_limit(memory_limit, self.layout.n_workers)
        # Start with no workers: LocalCluster gives all its workers one spec, and each of
        # ours needs its own environment; new_worker_spec makes them, here and on scale.
        super().__init__(
            n_workers=0,
            threads_per_worker=threads,
            processes=True,
            memory_limit=memory_limit,
            scheduler_kwargs=scheduler_kwargs,
            protocol=self.layout.protocol,
            **kwargs,
        )
        # The specs go in here rather than through scale(), whose start runs in a callback
        # of its own: a worker that failed to start there was only logged, and the cluster
        # came up with none. The start below (or the awaiting of an asynchronous cluster)
        # raises it.
        for _ in range(self.layout.n_workers):
            self.worker_spec.update(self.new_worker_spec())
        if not self.asynchronous:
            try:
                self.sync(self._correct_state)
            except BaseException:
                self.close()
                raise

    async def _start(self) -> None:
        # The scheduler starts here, and with it UCX in this process (when it is the
        # protocol): with the transports the workers get.
        with self.layout.comm_config():
            await super()._start()
        await self.scheduler_comm.register_worker_plugin(
            plugin=dumps(self.plugin), name=self.plugin.name, idempotent=False
        )

    def new_worker_spec(self) -> dict[int, dict[str, Any]]:
        """The next worker's spec: the lowest free index, with its GPU's environment."""
        i = 0
        while i in self.worker_spec:
            i += 1
        options = dict(self.new_spec["options"])
        options["env"] = {**(options.get("env") or {}), **self.layout.env(i)}
        options["config"] = {**(options.get("config") or {}), **self.layout.worker_config()}
        # Plugins a worker starts with are set up before it registers, and so before the
        # OverlapPlugin the scheduler hands it: the CPU affinity is set when the runtime
        # counts its cores (see dask_overlap.cluster.affinity).
        options["plugins"] = [*self.layout.plugins(i), *(options.get("plugins") or ())]
        return {i: {"cls": self.new_spec["cls"], "options": options}}
