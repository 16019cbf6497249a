"""One block (CuPy, or NumPy with ``--host``) moved between two workers on one GPU over
UCX, timed per size (#16).

Prints, per block size, the seconds of the dependent task and the fetch's duration and
GB/s from the receiving worker's transfer log. UCX's own variables (``UCX_PROTO_INFO=y``
to see which protocol it picked, ``UCX_RNDV_SCHEME``) pass to the workers through the
environment.

Run on the device: ``python3 benchmarks/diagnostics/ucx_probe.py [--sizes 256MiB,1GiB]``.
"""

from __future__ import annotations

import argparse
import time

from dask.utils import format_bytes, parse_bytes
from distributed import Client, wait

import dask_overlap
from dask_overlap.metrics.worker import transfer_spans


def make(nbytes: int, host: bool):
    if host:
        import numpy

        return numpy.ones(nbytes // 4, dtype="float32")
    import cupy

    return cupy.ones(nbytes // 4, dtype="float32")


def nbytes(x) -> int:
    return int(x.nbytes)


def last_fetch(dask_worker) -> tuple[float, int]:
    """Run on a worker: seconds and bytes of its newest fetch from another worker."""
    spans = transfer_spans(list(dask_worker.transfer_incoming_log)[-1:])
    return (spans[0].end - spans[0].start, spans[0].nbytes) if spans else (0.0, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16MiB,256MiB,256MiB,256MiB,1GiB,1GiB")
    p.add_argument("--protocol", default="ucxx")
    p.add_argument("--host", action="store_true", help="NumPy blocks, not CuPy ones")
    args = p.parse_args()
    cluster = dask_overlap.LocalGPUCluster(
        n_workers=2, threads_per_worker=4, protocol=args.protocol
    )
    with cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        for size in [parse_bytes(s) for s in args.sizes.split(",")]:
            block = client.submit(make, size, args.host, workers=[a], pure=False)
            wait(block)
            t0 = time.perf_counter()
            got = client.submit(nbytes, block, workers=[b], pure=False).result()
            seconds = time.perf_counter() - t0
            took, moved = client.run(last_fetch, workers=[b])[b]
            print(
                f"{format_bytes(got):>10}: task {seconds * 1e3:7.2f} ms; fetch "
                f"{took * 1e3:7.2f} ms, {moved / max(took, 1e-9) / 1e9:7.1f} GB/s",
                flush=True,
            )
            del block


if __name__ == "__main__":
    main()
