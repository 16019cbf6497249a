"""The protocol a cluster's processes talk over, and UCX's transports when it is UCX.

:class:`~dask_overlap.LocalGPUCluster` (``protocol=``) and ``dask overlap worker``
(``--protocol``, or the scheme of the scheduler's address) hand the protocol to
distributed as it is: ``tcp`` by default, ``ucxx`` (or ``ucx``) for UCX through
``distributed-ucxx``, which registers both schemes with distributed. No transport of our
own: this module only checks the choice before anything starts, says what to install
when UCX is missing, and picks UCX's transports.

The transports are those dask-cuda sets when asked for TCP and NVLink (``tcp``,
``cuda_copy``, ``cuda_ipc``; ``UCX_SOCKADDR_TLS_PRIORITY=tcp``), plus ``sm`` and
``self``: a partition's result is an ordinary NumPy array by default, and between two
workers of one machine such a host buffer goes through shared memory rather than
loopback TCP. Inside a node, device buffers go by CUDA IPC and copies to and from the GPU
by ``cuda_copy``; between nodes, and for what nothing else carries, by TCP. A CPU-path
cluster (no GPU) leaves the CUDA transports out.

They reach the worker processes as ``UCX_*`` environment variables (UCX reads them when
distributed-ucxx starts it, and they win over its Dask settings), and the process that
hosts the scheduler, the client or the nannies through ``distributed-ucxx.environment``
in ``dask.config``, set while they start (UCX starts once per process). On a GPU, every
process also asks distributed-ucxx for a CUDA context before UCX starts
(``distributed-ucxx.create-cuda-context``), as dask-cuda does. A user who chose
transports already, in ``UCX_TLS`` or in ``distributed-ucxx``'s (or the older
``distributed.comm.ucx``) ``tcp`` / ``nvlink`` / ``infiniband`` / ``environment.tls``
settings, keeps them: nothing is set then (to add InfiniBand between nodes, for example,
``UCX_TLS=rc,tcp,sm,self,cuda_copy,cuda_ipc``, or ``UCX_TLS=all`` to let UCX choose).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
from collections.abc import Mapping
from typing import Any

import dask.config

__all__ = [
    "CPU_TRANSPORTS",
    "GPU_TRANSPORTS",
    "UCX_PROTOCOLS",
    "UCXSettings",
    "check_protocol",
    "device_memory_resource",
    "is_ucx",
    "protocols",
    "require_ucx",
    "scheme_of",
    "ucx_settings",
]

# Both name distributed-ucxx's backend: it registers "ucx" and "ucxx" through the
# distributed.comm.backends entry point (without it, distributed 2026.8 keeps a "ucx"
# stub that only raises).
UCX_PROTOCOLS = ("ucx", "ucxx")

# Schemes distributed itself ships for workers in processes of their own ("inproc" keeps
# them in this process, which one worker process per GPU rules out).
_BUILTIN = ("tcp", "tls", "ws", "wss")

CPU_TRANSPORTS = ("tcp", "sm", "self")
GPU_TRANSPORTS = ("cuda_copy", "cuda_ipc")

# The keys of dask-cuda's transport switches, which distributed-ucxx turns into UCX_TLS.
_SWITCHES = ("tcp", "nvlink", "infiniband")
_NAMESPACES = ("distributed-ucxx", "distributed.comm.ucx")

# distributed's per-request byte limit on fetches from one peer (50 MB by default), on a GPU
# worker over UCX. A worker has one request to a given peer under way at a time, each with
# a cost of its own beside its bytes (on one H200, a lone 256 MiB or 1 GiB CuPy block moved
# between two workers in 3.4-3.7 ms alike), so chunks of hundreds of MiB, one a request,
# queue up behind each other: benchmarks/bench_cross.py, ucxx, device chunks of 256 MiB,
# crossing 93.6 GB/s at 50 MB, 121.3 at 1 GiB, 128.8 at 8 GiB (one run each).
UCX_GPU_MESSAGE_BYTES = 2**30
_MESSAGE_BYTES_KEY = "distributed.worker.transfer.message-bytes-limit"

_MISSING = (
    "{what} needs distributed-ucxx, which {why}: pip install 'dask_overlap[ucx-cuda13]' "
    "for a CUDA 13 driver (distributed-ucxx-cu13), or 'dask_overlap[ucx-cuda12]' for "
    "CUDA 12 (distributed-ucxx-cu12); each brings UCX with it"
)


def protocols() -> tuple[str, ...]:
    """The protocols workers of ours may use: distributed's own (but ``inproc``), UCX,
    and any other backend a package registers (``distributed.comm.backends``).

    Examples
    --------
    >>> {"tcp", "ucx", "ucxx"} <= set(protocols())
    True
    """
    found = {ep.name for ep in importlib.metadata.entry_points(group="distributed.comm.backends")}
    return tuple(sorted((set(_BUILTIN) | set(UCX_PROTOCOLS) | found) - {"inproc"}))


def scheme_of(address: str | None) -> str | None:
    """The scheme of an address (``"ucxx"`` of ``"ucxx://10.0.0.1:8786"``), or ``None``.

    Examples
    --------
    >>> scheme_of("ucxx://10.0.0.1:8786"), scheme_of("10.0.0.1:8786")
    ('ucxx', None)
    """
    if not address or "://" not in address:
        return None
    return address.split("://", 1)[0]


def check_protocol(protocol: Any, name: str = "protocol") -> str | None:
    """``protocol`` without its ``://``, or raise naming ``name`` if no worker can use it.

    ``None`` stays ``None`` (distributed's default: ``tcp``, or the scheduler's scheme).

    Examples
    --------
    >>> check_protocol("tcp://"), check_protocol(None)
    ('tcp', None)
    """
    if protocol is None:
        return None
    allowed = protocols()
    scheme = protocol.removesuffix("://") if isinstance(protocol, str) else protocol
    if scheme not in allowed:
        hint = (
            " (inproc keeps workers in this process; dask_overlap starts one worker "
            "process per GPU)"
            if scheme == "inproc"
            else ""
        )
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {protocol!r}{hint}")
    return scheme


def is_ucx(protocol: str | None) -> bool:
    """Whether ``protocol`` (a scheme, as :func:`check_protocol` returns it) is UCX."""
    return protocol in UCX_PROTOCOLS


def device_memory_resource(choice: str, address: str | None) -> str:
    """The RMM resource (``overlap.device-memory-resource``) for a worker at ``address``.

    ``"auto"`` is ``"pool"`` (RMM's pool over ``cudaMalloc``) on a UCX worker and
    ``"async"`` (CUDA's stream-ordered pool) on any other: UCX cannot hand memory from
    ``cudaMallocAsync`` to another process by CUDA IPC (``cuIpcGetMemHandle`` refuses it),
    so it stages every device chunk through bounce buffers (0.79 GB/s between two workers
    on an H200, against 13 GB/s by CUDA IPC). A named resource stays what it is.

    Examples
    --------
    >>> device_memory_resource("auto", "ucxx://10.0.0.1:40000")
    'pool'
    >>> device_memory_resource("auto", "tcp://10.0.0.1:40000"), device_memory_resource("async", "ucxx://h:1")
    ('async', 'async')
    """
    if choice != "auto":
        return choice
    return "pool" if is_ucx(scheme_of(address)) else "async"


def require_ucx(what: str) -> None:
    """Import distributed-ucxx, or raise an ImportError that says what to install.

    ``what`` names the choice that needs it (``"protocol='ucxx'"``). Called before any
    process starts; without the package, distributed would fail later, in each process,
    with ``unknown address scheme`` (or, for ``ucx``, a stub's FutureWarning).
    """
    try:
        importlib.import_module("distributed_ucxx")
    except ImportError as e:
        why = "is not installed" if e.name == "distributed_ucxx" else f"did not import ({e})"
        raise ImportError(_MISSING.format(what=what, why=why)) from e


def _transports_chosen(environ: Mapping[str, str]) -> bool:
    """Whether the user chose UCX's transports already (environment or Dask settings)."""
    if "UCX_TLS" in environ:
        return True
    for namespace in _NAMESPACES:
        if any(dask.config.get(f"{namespace}.{k}", None) is not None for k in _SWITCHES):
            return True
        if "tls" in (dask.config.get(f"{namespace}.environment", None) or {}):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class UCXSettings:
    """UCX's transports for a cluster's processes; built by :func:`ucx_settings`.

    ``transports`` is empty when the user chose them already (nothing is set then).
    """

    transports: tuple[str, ...]
    create_cuda_context: bool
    #: distributed's per-request fetch limit for the workers (None: theirs as it is).
    message_bytes_limit: int | None = None

    def env(self) -> dict[str, str]:
        """``UCX_*`` variables for a worker process (its environment, set before it starts
        UCX).

        Examples
        --------
        >>> UCXSettings(("tcp", "sm", "self"), False).env()
        {'UCX_TLS': 'tcp,sm,self', 'UCX_SOCKADDR_TLS_PRIORITY': 'tcp'}
        """
        if not self.transports:
            return {}
        return {"UCX_TLS": ",".join(self.transports), "UCX_SOCKADDR_TLS_PRIORITY": "tcp"}

    def config(self) -> dict[str, Any]:
        """``dask.config`` settings for the process that hosts the scheduler, the client or
        the nannies, to hold while they start: the same variables through
        ``distributed-ucxx.environment`` (merged into what is there), and
        :meth:`worker_config`.

        Examples
        --------
        >>> UCXSettings(("tcp", "sm", "self"), False).config()
        {'distributed-ucxx.environment': {'tls': 'tcp,sm,self', 'sockaddr-tls-priority': 'tcp'}}
        """
        out: dict[str, Any] = {}
        if self.transports:
            environment = dict(dask.config.get("distributed-ucxx.environment", None) or {})
            environment["tls"] = ",".join(self.transports)
            environment["sockaddr-tls-priority"] = "tcp"
            out["distributed-ucxx.environment"] = environment
        return {**out, **self.worker_config()}

    def worker_config(self) -> dict[str, Any]:
        """``dask.config`` settings for a worker process: on a GPU, the CUDA context that
        distributed-ucxx creates before it starts UCX (as dask-cuda asks for; our own
        transports include CUDA's, which makes it create one anyway; this is for
        transports the user chose, such as ``UCX_TLS=all``), and the fetch limit.

        Examples
        --------
        >>> UCXSettings((), True).worker_config()
        {'distributed-ucxx.create-cuda-context': True}
        >>> UCXSettings((), True, 2**30).worker_config()[_MESSAGE_BYTES_KEY]
        1073741824
        """
        out: dict[str, Any] = {}
        if self.create_cuda_context:
            out["distributed-ucxx.create-cuda-context"] = True
        if self.message_bytes_limit is not None:
            out[_MESSAGE_BYTES_KEY] = self.message_bytes_limit
        return out


def ucx_settings(gpu: bool, environ: Mapping[str, str] | None = None) -> UCXSettings:
    """The transports of a UCX cluster: ``tcp,sm,self``, and ``cuda_copy,cuda_ipc`` when
    ``gpu``; none when ``UCX_TLS`` (in ``environ``, default ``os.environ``) or
    distributed-ucxx's settings chose them already. On a GPU, fetches of up to
    :data:`UCX_GPU_MESSAGE_BYTES` a request, unless the user set distributed's limit.

    Examples
    --------
    >>> ucx_settings(gpu=True, environ={}).env()["UCX_TLS"]
    'tcp,sm,self,cuda_copy,cuda_ipc'
    >>> ucx_settings(gpu=True, environ={"UCX_TLS": "all"}).env()
    {}
    """
    environ = os.environ if environ is None else environ
    limit = UCX_GPU_MESSAGE_BYTES if gpu and not _user_set(_MESSAGE_BYTES_KEY) else None
    if _transports_chosen(environ):
        return UCXSettings((), create_cuda_context=gpu, message_bytes_limit=limit)
    transports = CPU_TRANSPORTS + (GPU_TRANSPORTS if gpu else ())
    return UCXSettings(transports, create_cuda_context=gpu, message_bytes_limit=limit)


def _user_set(key: str) -> bool:
    """Whether ``key`` differs from the default its package registered with Dask."""
    default = None
    for defaults in dask.config.defaults:
        default = dask.config.get(key, default, config=defaults)
    return dask.config.get(key, None) != default
