"""``python -m dask_overlap``: the same command as ``dask overlap`` and ``dask-overlap``."""

from __future__ import annotations

from .cluster.cli import main

if __name__ == "__main__":
    main(prog_name="python -m dask_overlap")
