"""What Dask alone costs a block of a batched stage, on the threaded scheduler.

``batch="auto"`` joins small blocks into partitions and cuts each partition's output back
into the blocks, a slice task a block, so that the array keeps its input's chunks
(:mod:`dask_overlap.graph.batch`). This runs graphs of that shape with no work in them,
in plain Dask: ``--blocks`` literal blocks, a gather a batch of ``--k``, a partition
task a batch (it returns a ready array) and, unless ``cuts`` is left out, a slice task a
block; the tasks as legacy tuples, as Dask's task objects, and with each gather inside
its partition's task. Each line is the best of ``--repeat`` ``dask.threaded.get`` calls
(Dask's conversion, ordering and scheduling, nothing else), in microseconds a block: the
floor under a small-block stage, whatever the partitions do.

On the 2-core CPU machine (2026-12-06): 46-50 us a block with the slices, 14 without.
On the H100 machine's host the same day, in two calls: 126 and 75 with tuples, 106 and
65 with task objects, 99 and 65 with the gathers inside the partitions, 29 and 17 without
the slices (``benchmarks/results/small-blocks.txt``); a 4 MiB block moves in about 100 us
at that card's bound.

Run anywhere: ``python3 benchmarks/diagnostics/dask_floor.py``.
"""

from __future__ import annotations

import argparse
import operator
import time

import dask
import numpy as np
from dask._task_spec import Task, TaskRef


def gather(axis: int, *blocks: np.ndarray) -> tuple:
    return blocks


def graph(form: str, blocks: int, k: int, rows: int, cuts: bool) -> tuple[dict, list]:
    """The graph of ``form`` (``tuple``, ``task`` or ``inline``) and the keys asked of it."""
    data = [np.ones((rows, 8)) for _ in range(blocks)]
    out = np.ones((rows * k, 8))

    def partition(joined: tuple) -> np.ndarray:
        return out[: rows * len(joined)]

    dsk: dict = {("in", i): data[i] for i in range(blocks)}
    for p in range(-(-blocks // k)):
        refs = [("in", j) for j in range(p * k, min(p * k + k, blocks))]
        if form == "tuple":
            dsk[("g", p)] = (gather, 0, *refs)
            dsk[("p", p)] = (partition, ("g", p))
        elif form == "task":
            dsk[("g", p)] = Task(("g", p), gather, 0, *map(TaskRef, refs))
            dsk[("p", p)] = Task(("p", p), partition, TaskRef(("g", p)))
        else:
            joined = Task(None, gather, 0, *map(TaskRef, refs))
            dsk[("p", p)] = Task(("p", p), partition, joined)
        for c, j in enumerate(range(p * k, p * k + len(refs))):
            index = (slice(c * rows, c * rows + rows), slice(None))
            if form == "tuple":
                dsk[("c", j)] = (operator.getitem, ("p", p), index)
            else:
                dsk[("c", j)] = Task(("c", j), operator.getitem, TaskRef(("p", p)), index)
    if cuts:
        return dsk, [("c", j) for j in range(blocks)]
    dsk = {key: v for key, v in dsk.items() if key[0] != "c"}
    return dsk, [key for key in dsk if key[0] == "p"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--k", type=int, default=16, help="blocks a partition")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--forms", default="tuple,task,inline,task-without-cuts")
    args = p.parse_args(argv)
    for form in args.forms.split(","):
        kind, _, without = form.partition("-without-")
        best = float("inf")
        for _ in range(args.repeat):
            dsk, keys = graph(kind, args.blocks, args.k, 4, cuts=not without)
            t0 = time.perf_counter()
            dask.threaded.get(dsk, keys, num_workers=args.threads)
            best = min(best, time.perf_counter() - t0)
        print(
            f"{form:20s} {len(dsk):4d} keys  {best * 1e3:7.2f} ms  "
            f"{best / args.blocks * 1e6:6.1f} us a block",
            flush=True,
        )


if __name__ == "__main__":
    main()
