"""What a GPU worker's CPU affinity changes: pinned copies and staging, on near, all, far cores.

``overlap.cpu-affinity`` keeps each GPU worker on the cores NVML reports near its GPU
(``dask_overlap.cluster.affinity``). This measures what that changes for the work that runs on
those cores, in one process and one run. For each case the whole process (every thread)
is moved to the case's cores, a fresh runtime is built there (its pinned pool allocated
and its copy threads counted from the cores, as in a worker whose affinity is set before
its runtime) and fresh input is made there (its pages first touched on those cores), then:

1. the stage rates (``common.measure_ceilings``): H2D and D2H from and into pinned
   memory, both at once, staging (pageable input into the pinned ring) and unstaging
   (the ring into fresh arrays) with the runtime's copy threads;
2. pageable H2D and D2H (the driver's own staging, a memcpy on the calling core);
3. the default path of ``bench_default.py``: ``dask_overlap.map_blocks`` with no
   settings, ``split_axis=0`` and without, persisted on Dask's threaded scheduler, each
   result compared element by element with the naive path's.

Cases: ``near`` (NVML's cores for the GPU, within this process's affinity), ``all`` (this
process's affinity as it started), ``far`` (the others: cores of the other NUMA nodes,
only on a machine with more than one) and ``half`` (the first half of the near cores,
or of all when NVML does not know them: what staging owes to the number of cores). The
cases alternate over ``--rounds``; the best of each is kept. Also printed: the NUMA
layout (``/sys/devices/system/node``) and the GPU's place in it (NVML and sysfs).

Example (CPU, small: no GPU, so only ``all`` and ``half``)::

    python benchmarks/diagnostics/affinity.py --size 256MiB --partition 32MiB --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import numpy as np
from dask.utils import format_bytes, parse_bytes

import dask_overlap
from dask_overlap.cluster.affinity import nvml_cores, process_cores, restrict, set_process_affinity
from dask_overlap.cluster.local import visible_gpus

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    array_of_views,
    best_persist,
    make_kernel,
    measure_ceilings,
    naive,
    random_data,
    same_chunks,
    warm_up,
    write_json,
)

GB = 1e9
COLS = 1024


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` (the kernel's CPU list format) as ``[0, 1, 2, 3, 8, 10, 11]``."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def numa_nodes() -> dict[int, list[int]]:
    """CPUs of each NUMA node, from ``/sys/devices/system/node`` (``{}`` where absent)."""
    root = "/sys/devices/system/node"
    nodes = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(root, name, "cpulist")) as f:
                nodes[int(name[4:])] = parse_cpulist(f.read())
    return nodes


def gpu_place(device: str) -> dict[str, Any]:
    """Where GPU ``device`` sits: NVML's name, PCI bus, NUMA node and near cores, and
    the kernel's view of the same PCI slot."""
    out: dict[str, Any] = {"device": device, "nvml_cores": nvml_cores(device)}
    try:
        import pynvml
    except ImportError:
        out["nvml"] = "nvidia-ml-py is not installed"
        return out
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        out["nvml"] = f"NVML did not start: {e}"
        return out
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(device)) if device.isdigit() else None
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByUUID(device)
        name = pynvml.nvmlDeviceGetName(handle)
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
        out["name"] = name.decode() if isinstance(name, bytes) else name
        out["pci_bus"] = (bus.decode() if isinstance(bus, bytes) else bus).lower()
        try:
            out["nvml_numa_node"] = pynvml.nvmlDeviceGetNumaNodeId(handle)
        except (pynvml.NVMLError, AttributeError) as e:  # older drivers, older bindings
            out["nvml_numa_node"] = f"unknown ({e})"
    except (pynvml.NVMLError, AttributeError) as e:  # AttributeError: older bindings
        out["nvml"] = f"NVML does not know GPU {device}: {e!r}"
    finally:
        pynvml.nvmlShutdown()
    slot = f"/sys/bus/pci/devices/{out.get('pci_bus', '')[-12:]}"
    if "pci_bus" in out and os.path.isdir(slot):
        with open(f"{slot}/numa_node") as f:
            out["sysfs_numa_node"] = int(f.read())
        with open(f"{slot}/local_cpulist") as f:
            out["sysfs_local_cpus"] = parse_cpulist(f.read())
    return out


def cases(start: list[int], near: list[int] | None, wanted: list[str]) -> dict[str, list[int]]:
    """The cores of each case (see the module docstring); a case with no cores is left
    out, and so is ``half`` when it has the same cores as another (one near core)."""
    base = near or start
    found = {
        "near": near or [],
        "all": start,
        "far": sorted(set(start) - set(near or start)),
        "half": base[: max(1, len(base) // 2)],
    }
    chosen: dict[str, list[int]] = {}
    for name in wanted:
        cores = found.get(name)
        if cores and not (name == "half" and cores in chosen.values()):
            chosen[name] = cores
    return chosen


def pageable_rates(block: np.ndarray, repeat: int = 3) -> dict[str, float]:
    """Pageable H2D and D2H of ``block`` (CUDA): the driver stages them through buffers
    of its own with a memcpy on the calling core."""
    import cupy as cp

    dev = cp.empty(block.shape, block.dtype)
    out = np.ones_like(block)  # touched: the copy, not page faults
    copies = {"pageable_h2d": lambda: dev.set(block), "pageable_d2h": lambda: dev.get(out=out)}
    rates = {}
    for name, copy in copies.items():
        best = float("inf")
        for _ in range(repeat):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            copy()
            cp.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
        rates[name] = block.nbytes / best
    return rates


def run_case(
    name: str, cores: list[int], args: argparse.Namespace, iterations: int | None, ref: Any
) -> tuple[dict[str, Any], int, list[np.ndarray] | None]:
    """One case on ``cores``; returns its figures, the kernel iterations (calibrated on
    the first case, reused after) and, for the first case, the naive result."""
    set_process_affinity(cores)
    dask_overlap.close_runtimes()  # the next one is built here, on these cores
    gc.collect()
    rt = dask_overlap.get_runtime()
    size, part = parse_bytes(args.size), parse_bytes(args.partition)
    rows, rows_per_part = max(1, size // (4 * COLS)), max(1, part // (4 * COLS))
    t0 = time.perf_counter()
    # The same data in every case (random_data seeds each of its 16 slices), its pages
    # first touched on these cores.
    host = random_data((rows, COLS))
    made = time.perf_counter() - t0
    block = host[:rows_per_part]
    rates, _, calibrated = measure_ceilings(rt, block, "balanced")
    if rt.name == "cuda":
        rates.update(pageable_rates(block))
    iterations = calibrated if iterations is None else iterations
    func = make_kernel(iterations)
    x = array_of_views(host, rows_per_part)
    split = dask_overlap.map_blocks(func, x, split_axis=0, dtype=np.float32)
    whole = dask_overlap.map_blocks(func, x, dtype=np.float32)
    warm_up(split, whole)  # compilation, pools, first touch
    if ref is None:
        _, ref = best_persist(naive(x, func), 1)
        new_ref = ref
    else:
        new_ref = None
    split_s, got = best_persist(split, args.repeat)
    correct = same_chunks(ref, got)
    del got
    whole_s, got = best_persist(whole, args.repeat)
    correct = correct and same_chunks(ref, got)
    del got
    result = {
        "cores": cores,
        "copy_threads": rt.copy_threads,
        "backend": rt.name,
        "input_gbps_made": host.nbytes / made / GB,
        "rates_gbps": {
            k: v / GB for k, v in rates.items() if isinstance(v, float) and k != "host_cores"
        },
        "split_gbps": host.nbytes / split_s / GB,
        "nosplit_gbps": host.nbytes / whole_s / GB,
        "correct": bool(correct),
    }
    del host, x, split, whole, block
    return result, iterations, new_ref


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the best over rounds (a case's rounds differ by noise only)."""
    out = dict(runs[0])
    out["rates_gbps"] = {
        k: max(r["rates_gbps"].get(k, 0.0) for r in runs) for k in runs[0]["rates_gbps"]
    }
    for k in ("split_gbps", "nosplit_gbps", "input_gbps_made"):
        out[k] = max(r[k] for r in runs)
    out["correct"] = all(r["correct"] for r in runs)
    out["rounds"] = runs
    return out


def flat(case: dict[str, Any]) -> dict[str, float]:
    return {
        **case["rates_gbps"],
        "default split": case["split_gbps"],
        "default no split": case["nosplit_gbps"],
    }


def report(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Print a table of GB/s per case and the ratios near/all and near/far; return them."""
    names = list(results)
    rows = list(flat(results[names[0]]))
    wanted = (("near", "all"), ("near", "far"), ("all", "half"))
    pairs = [(a, b) for a, b in wanted if a in results and b in results]
    head = f"  {'GB/s':18}" + "".join(f"{n:>10}" for n in names)
    head += "".join(f"{a + '/' + b:>11}" for a, b in pairs)
    print(head)
    ratios: dict[str, dict[str, float]] = {f"{a}/{b}": {} for a, b in pairs}
    for row in rows:
        values = {n: flat(results[n]).get(row, float("nan")) for n in names}
        line = f"  {row:18}" + "".join(f"{values[n]:10.2f}" for n in names)
        for a, b in pairs:
            r = values[a] / values[b] if values[b] else float("nan")
            ratios[f"{a}/{b}"][row] = r
            line += f"{r:11.3f}"
        print(line)
    threads = " ".join(f"{n}={results[n]['copy_threads']}" for n in names)
    print(f"  copy threads: {threads}")
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="8GiB", help="input bytes of the default path (float32)")
    p.add_argument("--partition", default="256MiB", help="bytes per Dask partition")
    p.add_argument("--repeat", type=int, default=2, help="timed persists per path; best kept")
    p.add_argument("--rounds", type=int, default=2, help="times each case runs, alternating")
    p.add_argument("--cases", default="near,all,far,half", help="which cases, in this order")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    t_start = time.perf_counter()

    start = sorted(process_cores() or range(os.cpu_count() or 1))
    gpus = visible_gpus()
    device = gpus[0] if gpus else None
    place = gpu_place(device) if device is not None else {"device": None}
    near = restrict(place.get("nvml_cores") or place.get("sysfs_local_cpus") or [])
    nodes = numa_nodes()
    print(f"NUMA nodes: { ({n: f'{c[0]}-{c[-1]} ({len(c)})' for n, c in nodes.items()}) }")
    print(f"GPU: {place}")
    print(f"this process's cores at start: {start}; near the GPU: {near}")
    chosen = cases(start, near, [c for c in args.cases.split(",") if c])
    if near is None:
        print("  no near or far case: the GPU's cores are unknown (no GPU, or no NVML)")
    elif "far" in args.cases and "far" not in chosen:
        print("  no far case: the GPU's near cores are all of this process's cores")
    if near == start:
        print("  near and all are the same cores here: their ratio is the run's noise")

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    iterations, ref = None, None
    out: dict[str, Any] = {}
    for r in range(args.rounds):
        for name, cores in chosen.items():
            res, iterations, first_ref = run_case(name, cores, args, iterations, ref)
            ref = first_ref if ref is None else ref
            runs[name].append(res)
            print(
                f"round {r + 1} {name:5} ({len(cores)} cores, {res['copy_threads']} copy "
                f"threads): staging {res['rates_gbps'].get('staging', 0):.1f}, H2D "
                f"{res['rates_gbps'].get('h2d', 0):.1f}, default split {res['split_gbps']:.2f}"
                f" / no split {res['nosplit_gbps']:.2f} GB/s, correct={res['correct']} "
                f"[{time.perf_counter() - t_start:.0f} s]",
                flush=True,
            )
        # Written after every round: a run cut short by a time limit still leaves figures.
        results = {name: best_of(rs) for name, rs in runs.items()}
        out = {
            "backend": next(iter(results.values()))["backend"],
            "gpu": place,
            "numa_nodes": nodes,
            "start_cores": start,
            "near_cores": near,
            "size_bytes": parse_bytes(args.size),
            "partition_bytes": parse_bytes(args.partition),
            "kernel_iterations": iterations,
            "rounds_done": r + 1,
            "cases": results,
            "correct": all(c["correct"] for c in results.values()),
            "seconds": time.perf_counter() - t_start,
        }
        write_json(args.json, out)
    set_process_affinity(start)
    dask_overlap.close_runtimes()
    if not out:
        return out
    print(f"backend={out['backend']}, {format_bytes(out['size_bytes'])}, best of {args.rounds}:")
    out["ratios"] = report(out["cases"])
    print(f"correct={out['correct']}; {out['seconds']:.0f} s")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
