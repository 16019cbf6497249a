"""dask_overlap: Dask GPU work as an assembly line.

Copy-in, compute and copy-out of each partition overlap on every worker's GPU, through
bounded pools of pinned host memory and CUDA streams. The same engine runs on machines
with no GPU, over NumPy. Importing this package touches no GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import config as _config  # registers the overlap.* defaults with dask.config
from .config import Options, TimedModel
from .graph.fusion import explain
from .graph.map_blocks import map_blocks
from .graph.map_overlap import map_overlap
from .pipeline.current import get_runtime, runtime_stats
from .pipeline.runtime import Runtime, close_runtimes

if TYPE_CHECKING:
    from .cluster.local import LocalGPUCluster
    from .cluster.plugin import OverlapPlugin
    from .dashboard import OverlapSchedulerPlugin, register

__all__ = [
    "LocalGPUCluster",
    "Options",
    "OverlapPlugin",
    "OverlapSchedulerPlugin",
    "Runtime",
    "TimedModel",
    "close_runtimes",
    "explain",
    "get_runtime",
    "map_blocks",
    "map_overlap",
    "register",
    "runtime_stats",
]
__version__ = "0.1.0"
del _config


def __getattr__(name: str) -> Any:
    # The distributed integration loads on first use: importing distributed configures
    # its logging, which importing this package must not do.
    if name == "OverlapPlugin":
        from .cluster.plugin import OverlapPlugin

        return OverlapPlugin
    if name == "LocalGPUCluster":
        from .cluster.local import LocalGPUCluster

        return LocalGPUCluster
    if name in ("OverlapSchedulerPlugin", "register"):
        from . import dashboard

        return getattr(dashboard, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public API, the lazily loaded names included; not this module's own imports.
    return sorted([*__all__, "__version__"])
