"""Benchmark: partitions crossing Dask workers, by protocol and by where chunks live (#16).

For each ``--protocols`` entry and each ``--chunks`` kind a fresh two-worker
:class:`~dask_overlap.LocalGPUCluster` (on a one-GPU machine both workers share it) makes
a float32 input on the workers, its first half on one and its second half on the other
(block ``i`` of ``n`` on worker ``2 * i // n``). Each run then persists, untimed, stage 1
``y = dask_overlap.map_blocks(stage1, x, out=CHUNKS)`` (``out="host"``: NumPy blocks;
``out="device"``: CuPy blocks left on the GPU), under a fresh name so no replica of an
earlier run's ``y`` is left anywhere, and times, until every chunk exists, stage 2
``dask_overlap.map_blocks(add, y, other, out=CHUNKS)``:

- local: ``other`` is ``y``, so each task's inputs are on its own worker;
- local_reordered: ``other`` is ``y`` through the layer that reverses it in crossing,
  with its blocks in their own order: all local, and the same graph as crossing (a layer
  of aliases, which the partitions now read through: ``dask_overlap.graph.rewrite``; before,
  each alias was a task and a scheduling round), so crossing over this is what crossing
  workers costs;
- crossing: ``other`` is ``y`` with its blocks reversed, so task ``i`` adds blocks ``i``
  and ``n-1-i``, which that placement puts on different workers (every pair but the
  middle one of an odd number of partitions). Each block is an input of two mirrored
  tasks, so between half and all of ``y`` moves; ``moved`` is what the workers' transfer
  logs say; for crossing, the fetches are summarised too (how many, how long each, how
  soon the first began, and the part of the stage during which one was under way).

GB/s is the bytes of stage 2's two inputs (twice ``--size``) over its seconds, in both
columns, so crossing/local is the ratio of the times. The best of ``--repeat`` runs, after
one warm-up, is kept; the pairs that crossed are counted from ``who_has`` of each pair's
two inputs before the run. Each variant's last result is compared on the cluster with
plain ``dask.array`` on the host, from the same persisted input.

On a machine with no GPU (``--allow-cpu``) the workers run the host backend, whose
"device" arrays are NumPy arrays: the two chunk kinds then measure the same path. A
protocol whose package is missing (``ucxx`` without ``distributed-ucxx``) is reported as
skipped, with the reason.

Example (issue 16's GPU check, two workers on one H200; the CPU check beside it)::

    python benchmarks/bench_cross.py --record  # benchmarks/results/cross-worker.json
    python benchmarks/bench_cross.py --allow-cpu --size 64MiB --partitions 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import uuid
from typing import Any

import dask.array as da
import numpy as np
from dask.core import flatten
from dask.utils import format_bytes
from distributed import Client, wait

import dask_overlap
from dask_overlap.cluster.ucx import check_protocol, is_ucx, require_ucx
from dask_overlap.metrics.timeline import busy_wall_seconds
from dask_overlap.metrics.worker import transfer_spans
from dask_overlap.pipeline.runtime import Span

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    COLS,
    add_output,
    add_repeat,
    byte_count,
    comma_list,
    parser,
    persist_timed,
    runtime_device,
    save,
)

CHUNKS = ("host", "device")
WORKERS = 2
TARGET_UCX = "ucxx device crossing >= 10 GB/s and >= 0.5 of local"
TARGET_TCP = "tcp device >= tcp host (crossing)"
GBPS = "GB/s = bytes of stage 2's two inputs (2 x size) / seconds until every chunk exists"


def stage1(a: Any) -> Any:
    """Stage 1: cheap and elementwise (NumPy or CuPy blocks); exact in float32."""
    return a * 2 + 1


def add(a: Any, b: Any) -> Any:
    """Stage 2: one block of each input."""
    return a + b


def to_host(block: Any) -> np.ndarray:
    """A CuPy block copied to a NumPy array (a NumPy block as it is)."""
    return block if isinstance(block, np.ndarray) else block.get()


def fetches_of(dask_worker: Any) -> list[Span]:
    """Run on a worker (``client.run``): its fetches from other workers so far, as the
    dashboard's transfer spans (in the scheduler's clock)."""
    return transfer_spans(getattr(dask_worker, "transfer_incoming_log", ()))


def transfer_summary(fetches: list[Span], t0: float, seconds: float) -> dict[str, Any]:
    """Where a stage's time went among its fetches: how many, how long each took (median),
    the GB/s of one, how long after the stage began the first started, and the part of the
    stage during which at least one was under way."""
    if not fetches:
        return {"fetches": 0}
    return {
        "fetches": len(fetches),
        "fetch_seconds_median": statistics.median(f.end - f.start for f in fetches),
        "fetch_gbps_median": statistics.median(
            f.nbytes / max(f.end - f.start, 1e-9) / 1e9 for f in fetches
        ),
        "first_fetch_after_seconds": min(f.start for f in fetches) - t0,
        "fetching_fraction_of_stage": busy_wall_seconds([(f.start, f.end) for f in fetches])
        / seconds,
    }


def reverse_blocks(a: da.Array) -> da.Array:
    """``a`` with its blocks along axis 0 in reverse order (block ``i`` is ``n-1-i``)."""
    return reorder_blocks(a, reversed(range(a.numblocks[0])))


def reorder_blocks(a: da.Array, order: Any) -> da.Array:
    """``a``'s blocks along axis 0 in ``order``: a graph layer of one alias task per block,
    which Dask schedules as tasks of their own."""
    return da.concatenate([a.blocks[i] for i in order])


#: Stage 2's second input, per variant: ``y`` itself, ``y`` through a reordering layer in
#: its own order (all local, the same graph shape as crossing), or ``y`` reversed.
VARIANTS = {
    "local": lambda y: y,
    "local_reordered": lambda y: reorder_blocks(y, range(y.numblocks[0])),
    "crossing": reverse_blocks,
}


def skip_reason(protocol: str) -> str | None:
    """Why ``protocol`` cannot run here (its package is missing), or ``None``."""
    if not is_ucx(check_protocol(protocol)):
        return None
    try:
        require_ucx(f"protocol={protocol!r}")
    except ImportError as e:
        return str(e)
    return None


def place_in_halves(client: Client, x: da.Array) -> da.Array:
    """``x`` persisted with block ``i`` of ``n`` on worker ``2 * i // n``, so blocks ``i``
    and ``n-1-i`` are on different workers (the scheduler's own placement need not spread
    a small input, nor keep halves apart)."""
    workers = sorted(client.scheduler_info()["workers"])
    n = x.numblocks[0]
    parts = [client.persist(x.blocks[i], workers=[workers[WORKERS * i // n]]) for i in range(n)]
    wait(parts)
    return da.concatenate(parts)


def placement(client: Client, y: da.Array) -> list[set[str]]:
    """The workers holding each block of ``y`` (persisted, one column of blocks)."""
    keys = list(flatten(y.__dask_keys__()))
    who = client.who_has(y)
    return [set(who[k]) for k in keys]


class Case:
    """One (protocol, chunks) measurement on its cluster: stage 1 and both stage-2 variants."""

    def __init__(self, client: Client, x: da.Array, out: str, nbytes: int):
        self.client, self.x, self.out, self.nbytes = client, x, out, nbytes
        ref_y = da.map_blocks(stage1, x, dtype=np.float32)
        self.reference = {
            v: da.map_blocks(add, ref_y, other(ref_y), dtype=np.float32)
            for v, other in VARIANTS.items()
        }

    def make_y(self) -> tuple[da.Array, list[set[str]]]:
        """Stage 1, persisted under fresh keys, and the workers holding each block."""
        name = f"cross-stage1-{uuid.uuid4().hex}"  # fresh keys: no replica of a past run
        y = dask_overlap.map_blocks(stage1, self.x, out=self.out, dtype=np.float32, name=name)
        y = self.client.persist(y)
        wait(y)
        return y, placement(self.client, y)

    def run(self, variant: str) -> dict[str, Any]:
        """Stage 1, then stage 2 of ``variant`` timed; its result kept for :meth:`check`."""
        y, where = self.make_y()
        n = len(where)
        other = VARIANTS[variant](y)
        partner = range(n - 1, -1, -1) if variant == "crossing" else range(n)
        crossed = sum(1 for i, j in zip(range(n), partner, strict=True) if not where[i] & where[j])
        before = {w: len(log) for w, log in self.client.run(fetches_of).items()}
        stage2 = dask_overlap.map_blocks(add, y, other, out=self.out, dtype=np.float32)
        t0 = time.time()
        seconds, done = persist_timed(stage2, client=self.client)
        fetches = [
            f for w, log in self.client.run(fetches_of).items() for f in log[before.get(w, 0) :]
        ]
        moved = sum(f.nbytes for f in fetches)
        spread = sorted(sum(1 for w in where if a in w) for a in set().union(*where))
        return {
            "seconds": seconds,
            "pairs_crossed": crossed,
            "pairs": n,
            "bytes_moved": moved,
            "y_blocks_per_worker": spread,
            "transfers": transfer_summary(fetches, t0, seconds),
            "done": done,
        }

    def check(self, variant: str, done: da.Array) -> bool:
        """``done`` equals plain Dask's result, element by element, compared on the cluster."""
        host = done.map_blocks(to_host, dtype=np.float32, meta=np.empty((0, 0), np.float32))
        return bool(self.client.compute((host == self.reference[variant]).all(), sync=True))

    def measure(self, repeat: int) -> dict[str, Any]:
        """One warm-up of each variant, then the best of ``repeat``; the last checked."""
        best: dict[str, dict[str, Any]] = {}
        correct = True
        for variant in VARIANTS:  # the warm-up
            self.run(variant)
        for r in range(repeat):
            for variant in VARIANTS:
                got = self.run(variant)
                done = got.pop("done")
                if variant not in best or got["seconds"] < best[variant]["seconds"]:
                    best[variant] = got
                if r == repeat - 1:
                    correct &= self.check(variant, done)
                del done  # frees its chunks before the next run
        local, crossing = best["local"], best["crossing"]
        reordered = best["local_reordered"]
        inputs = 2 * self.nbytes
        local_gbps = inputs / local["seconds"] / 1e9
        crossing_gbps = inputs / crossing["seconds"] / 1e9
        reordered_gbps = inputs / reordered["seconds"] / 1e9
        return {
            "local_gbps": local_gbps,
            "crossing_gbps": crossing_gbps,
            "crossing_over_local": crossing_gbps / local_gbps,
            # The same graph shape as crossing (a reordering layer), all local: crossing
            # over this is what crossing workers costs, the extra layer's round apart.
            "local_reordered_gbps": reordered_gbps,
            "crossing_over_local_reordered": crossing_gbps / reordered_gbps,
            "local_reordered_bytes_moved": reordered["bytes_moved"],
            "pairs_crossed": crossing["pairs_crossed"],
            "pairs": crossing["pairs"],
            "correct": correct,
            "skipped": None,
            "local_seconds": local["seconds"],
            "crossing_seconds": crossing["seconds"],
            "bytes_moved": crossing["bytes_moved"],
            "local_bytes_moved": local["bytes_moved"],
            "y_blocks_per_worker": crossing["y_blocks_per_worker"],
            "crossing_transfers": crossing["transfers"],
        }


def run_one(args: argparse.Namespace, protocol: str, chunks: str) -> dict[str, Any]:
    """One fresh cluster on ``protocol``, measured with ``chunks`` (see the module docstring)."""
    rows_per_part = max(1, args.size // (4 * COLS) // args.partitions)
    rows = rows_per_part * args.partitions  # equal partitions: reversed blocks stay aligned
    with (
        dask_overlap.LocalGPUCluster(
            n_workers=WORKERS,
            threads_per_worker=args.threads,
            protocol=protocol,
            allow_cpu=args.allow_cpu,
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        x = da.random.default_rng(0).random(
            (rows, COLS), chunks=(rows_per_part, COLS), dtype=np.float32
        )
        x = place_in_halves(client, x)
        out = Case(client, x, chunks, rows * COLS * 4).measure(args.repeat)
        backend = cluster.layout.options.backend
        device = client.submit(runtime_device, pure=False).result()
    return {**out, "backend": backend, "device": device}


def targets(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, bool | None]:
    """Issue 16's targets, ``None`` where a row they need did not run on a GPU (on the
    host backend "device" chunks are NumPy arrays: there is nothing to judge)."""

    def row(protocols: tuple[str, ...], chunks: str) -> dict[str, Any] | None:
        for protocol in protocols:
            r = results.get(protocol, {}).get(chunks)
            if r and r.get("crossing_gbps") is not None and r.get("backend") == "cuda":
                return r
        return None

    ucx = row(("ucxx", "ucx"), "device")
    tcp_dev, tcp_host = row(("tcp",), "device"), row(("tcp",), "host")
    ucx_met = None
    if ucx is not None:
        ucx_met = ucx["crossing_gbps"] >= 10 and ucx["crossing_over_local"] >= 0.5
    tcp_met = None
    if tcp_dev is not None and tcp_host is not None:
        tcp_met = tcp_dev["crossing_gbps"] >= tcp_host["crossing_gbps"]
    return {TARGET_UCX: ucx_met, TARGET_TCP: tcp_met}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    head = ("protocol", "chunks", "local GB/s", "crossing GB/s", "cross/local", "pairs crossed")
    lines = ["{:<9}{:<8}{:>11}{:>14}{:>12}{:>15}{:>12}  correct".format(*head, "moved")]
    for protocol, by_chunks in results.items():
        for chunks, r in by_chunks.items():
            if r.get("crossing_gbps") is None:
                why = "skipped" if r.get("skipped") else "failed"
                lines.append(f"{protocol:<9}{chunks:<8}{why} (see below)")
                continue
            pairs = f"{r['pairs_crossed']}/{r['pairs']}"
            lines.append(
                f"{protocol:<9}{chunks:<8}{r['local_gbps']:>11.2f}{r['crossing_gbps']:>14.2f}"
                f"{r['crossing_over_local']:>12.2f}{pairs:>15}"
                f"{format_bytes(r['bytes_moved']):>12}  {r['correct']}"
            )
            if r.get("local_reordered_gbps") is not None:
                lines.append(
                    f"{'':<17}local through the same reordering layer: "
                    f"{r['local_reordered_gbps']:.2f} GB/s; crossing over it "
                    f"{r['crossing_over_local_reordered']:.2f}"
                )
            t = r.get("crossing_transfers") or {}
            if t.get("fetches"):
                lines.append(
                    f"{'':<17}crossing: {t['fetches']} fetches, each "
                    f"{t['fetch_seconds_median'] * 1e3:.1f} ms ({t['fetch_gbps_median']:.1f} GB/s) "
                    f"median; first after {t['first_fetch_after_seconds'] * 1e3:.1f} ms; "
                    f"fetching {t['fetching_fraction_of_stage']:.0%} of the stage"
                )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--protocols", default="tcp,ucxx", help="a comma list (tcp, ucxx, ...)")
    p.add_argument("--chunks", default="host,device", help="a comma list of host, device")
    p.add_argument("--threads", type=int, default=4, help="threads per worker")
    p.add_argument("--allow-cpu", action="store_true", help="CPU workers when there is no GPU")
    p.add_argument("--size", type=byte_count, default="4GiB", help="input bytes (float32)")
    p.add_argument("--partitions", type=int, default=16, help="Dask partitions of the input")
    add_repeat(p, 3, "of each variant")
    add_output(p)
    args = p.parse_args(argv)
    protocols, kinds = comma_list(args.protocols, str), comma_list(args.chunks, str)
    try:
        for protocol in protocols:
            check_protocol(protocol, "--protocols")
    except ValueError as e:
        p.error(str(e))
    if not kinds or any(k not in CHUNKS for k in kinds):
        p.error(f"--chunks must be a comma list of {', '.join(CHUNKS)}; got {args.chunks!r}")
    for name in ("threads", "partitions", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1; got {getattr(args, name)}")

    results: dict[str, dict[str, dict[str, Any]]] = {}
    devices: set[str] = set()
    for protocol in protocols:
        results[protocol] = {}
        reason = skip_reason(protocol)
        for chunks in kinds:
            if reason is not None:
                results[protocol][chunks] = {"skipped": reason, "correct": None}
                continue
            try:
                r = run_one(args, protocol, chunks)
            except Exception as e:  # one failed row must not lose the others
                traceback.print_exc()
                results[protocol][chunks] = {"skipped": None, "correct": None, "error": repr(e)}
                continue
            devices.add(r.pop("device"))
            results[protocol][chunks] = r
            print(
                f"{protocol} {chunks}: local {r['local_gbps']:.2f} GB/s, crossing "
                f"{r['crossing_gbps']:.2f} GB/s, pairs crossed {r['pairs_crossed']}/"
                f"{r['pairs']}, correct={r['correct']}",
                flush=True,
            )
            if r["pairs_crossed"] < r["pairs"]:
                print(
                    f"note: only {r['pairs_crossed']} of {r['pairs']} pairs crossed (blocks of "
                    f"y per worker: {r['y_blocks_per_worker']})",
                    flush=True,
                )

    rows_per_part = max(1, args.size // (4 * COLS) // args.partitions)
    summary = {
        "device": ", ".join(sorted(devices)) or None,
        "workers": WORKERS,
        "threads_per_worker": args.threads,
        "size_bytes": rows_per_part * args.partitions * COLS * 4,
        "partitions": args.partitions,
        "partition_bytes": rows_per_part * COLS * 4,
        "repeat": args.repeat,
        "gbps": GBPS,
        "results": results,
        "targets": targets(results),
    }
    print(
        f"\n{WORKERS} workers x {args.threads} threads, {format_bytes(summary['size_bytes'])} "
        f"float32 in {args.partitions} partitions, device: {summary['device']}; {GBPS}; "
        "moved: bytes fetched between workers in the best crossing run"
    )
    print("\n".join(table(results)))
    for protocol, by_chunks in results.items():
        for why in sorted({r["skipped"] for r in by_chunks.values() if r.get("skipped")}):
            print(f"{protocol} skipped: {why}")
        for chunks, r in by_chunks.items():
            if r.get("error"):
                print(f"{protocol} {chunks} failed: {r['error']}")
    rows = [r for v in results.values() for r in v.values() if "backend" in r]
    if "device" in kinds and any(r["backend"] != "cuda" for r in rows):
        print("note: no GPU here: 'device' chunks are the host backend's NumPy arrays")
    for name, met in summary["targets"].items():
        print(f"target {name}: {'not evaluated (no such row on a GPU)' if met is None else met}")
    save(args, "cross-worker", summary, figures(summary), summary["device"] or "none")
    return summary


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a run (its history line): each row's GB/s, or why it did
    not run."""
    keys = ("local_gbps", "crossing_gbps", "crossing_over_local", "correct")
    out: dict[str, Any] = {"size_bytes": summary["size_bytes"]}
    for protocol, by_chunks in summary["results"].items():
        for chunks, r in by_chunks.items():
            row = {k: r[k] for k in keys} if r.get("crossing_gbps") is not None else None
            out[f"{protocol} {chunks}"] = row or {"skipped": r.get("skipped") or r.get("error")}
    return out


def failed(summary: dict[str, Any]) -> bool:
    """Whether a row that ran failed or gave a wrong result (skipped rows do not count)."""
    rows = [r for v in summary["results"].values() for r in v.values()]
    return any(r.get("error") or r.get("correct") is False for r in rows)


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
