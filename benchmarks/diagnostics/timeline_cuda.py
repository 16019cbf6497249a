"""Per-stream timeline of one partition on the GPU: naive Dask + CuPy beside dask_overlap.

Event timings (CUDA events recorded around every copy and kernel by the cuda backend's
tracing) of one 256 MiB float32 partition, first the naive way (copy in, compute, copy out
on the legacy default stream), then through ``dask_overlap.map_blocks`` with
``split_axis=0``. Writes a JSON of the spans and a PNG with one row per stream.

Example::

    python benchmarks/diagnostics/timeline_cuda.py --json out/timeline.json --png out/timeline.png
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import dask
import numpy as np
from dask.utils import parse_bytes

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import array_of_views, make_kernel, measure_ceilings, write_json  # noqa: E402

# As the /overlap page colours them: H2D blue, kernel green, D2H orange.
COLORS = {"h2d": "tab:blue", "compute": "tab:green", "d2h": "tab:orange"}


def trace(backend: Any, fn: Any) -> list[dict[str, Any]]:
    backend.trace.start()
    fn()
    return backend.trace.stop()


def summary(spans: list[dict[str, Any]]) -> dict[str, Any]:
    makespan = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    busy = {st: sum(s["end"] - s["start"] for s in spans if s["stage"] == st) for st in COLORS}
    return {"makespan_s": makespan, "busy_s": busy, "streams": len({s["stream"] for s in spans})}


def plot(panels: list[tuple[str, list[dict[str, Any]]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(s["end"] for _, spans in panels for s in spans) * 1e3
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.2 + 1.6 * len(panels)), sharex=True)
    for ax, (title, spans) in zip(axes, panels, strict=True):
        streams = sorted({s["stream"] for s in spans})
        for row, name in enumerate(streams):
            for s in (s for s in spans if s["stream"] == name):
                ax.broken_barh(
                    [(s["start"] * 1e3, (s["end"] - s["start"]) * 1e3)],
                    (row - 0.4, 0.8),
                    color=COLORS[s["stage"]],
                )
        ax.set_yticks(range(len(streams)), [n.replace("overlap-cuda-", "") for n in streams])
        ax.set_title(f"{title}: {summary(spans)['makespan_s'] * 1e3:.1f} ms")
        ax.set_xlim(0, end)
    axes[-1].set_xlabel("ms (CUDA event timings)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--partition", default="256MiB")
    p.add_argument(
        "--iterations", type=int, default=None, help="kernel length (default: balanced, calibrated)"
    )
    p.add_argument("--sub-chunk", default=None)
    p.add_argument("--json", required=True)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)

    rows = parse_bytes(args.partition) // 4096
    dask.config.set({"overlap.backend": "cuda", "overlap.pinned-pool-size": 12 * rows * 4096})
    rt = dask_overlap.get_runtime("cuda")
    backend = rt.backend
    block = backend.pinned.allocate(rows * 4096)
    host = block.view(np.float32).reshape(rows, 1024)
    host[...] = np.random.default_rng(0).random(host.shape, dtype=np.float32)
    if args.iterations is None:
        # Balanced: the kernel takes as long as the partition's H2D (common.measure_ceilings).
        _, _, args.iterations = measure_ceilings(rt, host, "balanced")
    func = make_kernel(args.iterations)
    sub = parse_bytes(args.sub_chunk) if args.sub_chunk else None

    def overlapped() -> np.ndarray:
        x = array_of_views(host, rows)
        y = dask_overlap.map_blocks(func, x, split_axis=0, sub_chunk_bytes=sub, dtype=np.float32)
        (done,) = dask.persist(y, scheduler="threads")
        return done

    for _ in range(2):  # warm-up: compilation, pools, first touch
        backend.naive(func, host)
        overlapped()
    naive = trace(backend, lambda: backend.naive(func, host))
    ours = trace(backend, overlapped)
    result = {
        "partition_bytes": host.nbytes,
        "kernel_iterations": args.iterations,
        "naive": summary(naive),
        "overlap": summary(ours),
        "naive_spans": naive,
        "overlap_spans": ours,
    }
    for name in ("naive", "overlap"):
        s = result[name]
        print(
            f"{name:8} makespan {s['makespan_s'] * 1e3:7.2f} ms  streams {s['streams']}  "
            + "  ".join(f"{k} {v * 1e3:6.2f} ms" for k, v in s["busy_s"].items())
        )
    write_json(args.json, result)
    if args.png:
        plot([("naive (legacy default stream)", naive), ("dask_overlap", ours)], args.png)
    dask_overlap.close_runtimes()
    return result


if __name__ == "__main__":
    main()
