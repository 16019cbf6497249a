"""A real pipeline: a Zarr v3 store in, a Gaussian filter on the GPU, a Zarr v3 store out.

The input is a stack of images, shape ``(n, height, width)``, float32, chunked along the
stack. Each image is smoothed by a 2-D Gaussian filter through
``dask_overlap.map_blocks`` (``cupyx.scipy.ndimage.gaussian_filter`` on the GPU,
``scipy.ndimage.gaussian_filter`` on the CPU path) and the result written to a new store,
with Dask's progress bar; then the throughput is printed: input bytes over the wall time of
read -> filter -> write, until the last chunk is in the output store.

The filter is exact, not a per-block approximation: its sigma along the stack axis is 0, so
each image is filtered on its own and the chunks (whole images) need no halo. The output
equals ``scipy.ndimage.gaussian_filter(stack, sigma=(0, s, s))`` of the whole stack, and
the same reason makes ``split_axis=0`` valid (a partition may be cut between images).

``--compare`` also runs the same pipeline with plain Dask, the usual way: on the GPU
``x.map_blocks(cupy.asarray)``, the cupyx filter, ``.map_blocks(cupy.asnumpy)``; on the
CPU, the SciPy filter. Both run on the same cluster, after an untimed warm-up of each
(kernel compilation, pools); dask_overlap runs first in the first run (so a cold page cache
would cost it, not the baseline) and the two take turns after that, and dirty pages are
flushed (``os.sync``) before each timed run. The two outputs are compared element by
element. Beside them it times the same read and write with no filter at all: the ceiling
the storage sets, which neither pipeline can pass (where both reach it, the disk, not the
GPU, sets the pace: put the stores on faster storage, ``/dev/shm`` for instance, to see
the filter's cost). ``--repeat N`` runs each pipeline N
times, each run reading the input under keys of its own (so no run reuses what another
computed), and reports the medians, with the ratio run by run.

Run it from a clone (the workers are processes that import this file)::

    python examples/zarr_pipeline.py --make 256MiB --chunk 16MiB --compare
    python examples/zarr_pipeline.py --make 8GiB --chunk 256MiB --compare --workdir /dev/shm/zp
    python examples/zarr_pipeline.py in.zarr out.zarr --make 256MiB

Stores not named on the command line (``in.zarr``, ``out.zarr`` and ``--compare``'s
``out-plain-dask.zarr``) go to ``--workdir``, or to a temporary folder removed at the
end: nothing is written where it is run from. ``--make SIZE`` writes a synthetic input
store when the input does not exist (256MiB when no input is named); an existing store
is used as it is (any 3-D store of images). ``--json PATH`` saves the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from dask.utils import format_bytes, parse_bytes

CODECS = ("zstd", "none")


def smooth(block: Any, sigma: float) -> Any:
    """Smooth each image of ``block`` (``(images, height, width)``) by a 2-D Gaussian.

    NumPy blocks go to SciPy, CuPy blocks to cupyx (on the block's current stream): one
    function for both backends of ``dask_overlap.map_blocks``.

    Examples
    --------
    >>> smooth(np.ones((2, 8, 8), "f4"), 1.0).shape
    (2, 8, 8)
    """
    if type(block).__module__.split(".")[0] == "cupy":
        from cupyx.scipy import ndimage
    else:
        from scipy import ndimage
    return ndimage.gaussian_filter(block, sigma=(0, sigma, sigma), mode="reflect")


def plain_dask(x: Any, sigma: float, gpu: bool) -> Any:
    """The same filter with plain Dask, as usually written (copy in, filter, copy out)."""
    if not gpu:
        return x.map_blocks(smooth, sigma=sigma, dtype=x.dtype)
    import cupy
    import cupyx.scipy.ndimage

    # dtype and meta given, so Dask does not call the functions on the client to find them.
    on_gpu = cupy.empty((0,) * x.ndim, dtype=x.dtype)
    d = x.map_blocks(cupy.asarray, dtype=x.dtype, meta=on_gpu)
    d = d.map_blocks(
        cupyx.scipy.ndimage.gaussian_filter, sigma=(0, sigma, sigma), dtype=x.dtype, meta=on_gpu
    )
    return d.map_blocks(cupy.asnumpy, dtype=x.dtype, meta=x._meta)


def images_per(nbytes: int, image_bytes: int) -> int:
    """How many whole images fit in ``nbytes`` (at least one)."""
    return max(1, nbytes // image_bytes)


def parse_image(text: str) -> tuple[int, int]:
    """``"1024x1024"`` -> ``(1024, 1024)``."""
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH, got {text!r}") from None
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return h, w


def store_chunk(chunk_images: int, wanted: int) -> int:
    """On-disk images per chunk: at most ``wanted``, and dividing ``chunk_images``.

    A Dask chunk that covers whole Zarr chunks is written by one task alone, so the writes
    need no lock.
    """
    k = max(1, min(wanted, chunk_images))
    while chunk_images % k:
        k -= 1
    return k


def compressors(codec: str) -> Any:
    """``compressors=`` for ``zarr.create_array``: Zarr's default (Zstd), or none."""
    return "auto" if codec == "zstd" else None


def make_input(path: Path, size: int, image: tuple[int, int], chunk: int, disk: int, codec: str):
    """Write a synthetic stack of float32 images (noise around a smooth pattern) to ``path``.

    Made on the cluster, chunk by chunk; not timed.
    """
    import dask.array as da
    import zarr

    image_bytes = image[0] * image[1] * 4
    n = images_per(size, image_bytes)
    c = images_per(chunk, image_bytes)
    k = store_chunk(c, images_per(disk, image_bytes))
    rng = da.random.default_rng(42)
    noise = rng.standard_normal((n, *image), chunks=(c, *image), dtype=np.float32)
    yy, xx = np.ogrid[: image[0], : image[1]]
    pattern = np.sin(yy / 17.0).astype("f4") * np.cos(xx / 23.0).astype("f4")
    z = zarr.create_array(
        store=str(path),
        shape=(n, *image),
        chunks=(k, *image),
        dtype="float32",
        compressors=compressors(codec),
        overwrite=True,
    )
    write(noise * np.float32(0.25) + pattern, z, c * image_bytes).compute()


def write(y: Any, z: Any, chunk_bytes: int) -> Any:
    """``da.to_zarr`` into an existing array, as a Delayed, with ``y``'s chunks kept.

    Into an existing ``zarr.Array`` Dask writes with no lock (to a path with ``mode="w"``
    it would take one lock for the whole cluster), after rechunking to "auto" chunks, which
    ``array.chunk-size`` set to our chunk's bytes makes our own chunks.
    """
    import dask
    import dask.array as da

    with dask.config.set({"array.chunk-size": chunk_bytes}):
        return da.to_zarr(y, z, compute=False)


def run_pipeline(client: Any, y: Any, out: Path, codec: str, disk_images: int) -> float:
    """Create ``out``, write ``y`` into it with a progress bar; the wall seconds it took."""
    import zarr
    from distributed import progress

    c = y.chunks[0][0]
    z = zarr.create_array(
        store=str(out),
        shape=y.shape,
        chunks=(store_chunk(c, disk_images), *y.shape[1:]),
        dtype=y.dtype,
        compressors=compressors(codec),
        overwrite=True,
    )
    stored = write(y, z, c * math.prod(y.shape[1:]) * y.dtype.itemsize)
    os.sync()  # the previous run's dirty pages are not this run's to write back
    t0 = time.perf_counter()
    future = client.compute(stored)
    progress(future)
    future.result()
    return time.perf_counter() - t0


def device_name(gpu: bool) -> str:
    """The GPU's name (run on a worker), else the CPU's model."""
    if gpu:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Zarr in, a Gaussian filter per image on the GPU (dask_overlap), Zarr out.",
    )
    p.add_argument(
        "input", type=Path, nargs="?",
        help="input Zarr v3 store (3-D: images, height, width); default: in.zarr in --workdir",
    )  # fmt: skip
    p.add_argument(
        "output", type=Path, nargs="?",
        help="output Zarr v3 store (replaced if it exists); default: out.zarr in --workdir",
    )  # fmt: skip
    p.add_argument(
        "--workdir", type=Path, metavar="DIR",
        help="folder of the stores not named (made if missing, kept); default: a temporary "
        "folder, removed at the end",
    )  # fmt: skip
    p.add_argument(
        "--make", metavar="SIZE",
        help="create the input, of SIZE bytes, if missing (default 256MiB when no input is named)",
    )  # fmt: skip
    p.add_argument(
        "--image", type=parse_image, default=(1024, 1024), metavar="HxW",
        help="image size for --make (default 1024x1024)",
    )  # fmt: skip
    p.add_argument(
        "--chunk", default="256MiB", metavar="SIZE",
        help="bytes per Dask chunk, in whole images (default 256MiB)",
    )  # fmt: skip
    p.add_argument(
        "--store-chunk", default="16MiB", metavar="SIZE",
        help="bytes per on-disk Zarr chunk of new stores, dividing --chunk (default 16MiB)",
    )  # fmt: skip
    p.add_argument(
        "--codec", choices=CODECS, default="zstd",
        help="compression of new stores (default zstd, Zarr's own default)",
    )  # fmt: skip
    p.add_argument("--sigma", type=float, default=2.0, help="in pixels (default 2)")
    p.add_argument(
        "--backend", choices=("auto", "cuda", "host"), default="auto",
        help="auto: cuda where a GPU is visible, else host (NumPy/SciPy)",
    )  # fmt: skip
    p.add_argument("--workers", type=int, help="default: one per GPU, or 2 on the CPU path")
    p.add_argument(
        "--threads", type=int,
        help="per worker (default: LocalGPUCluster's, 4 per GPU; on the CPU path the cores "
        "shared among the workers)",
    )  # fmt: skip
    p.add_argument("--compare", action="store_true", help="also run it with plain Dask")
    p.add_argument(
        "--repeat", type=int, default=1, metavar="N",
        help="run each pipeline N times, each under keys of its own, and report the medians "
        "(default 1)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")
    args = p.parse_args(argv)
    if args.input is None and args.make is None:
        args.make = "256MiB"
    for name in ("make", "chunk", "store_chunk"):
        value = getattr(args, name)
        if value is not None:
            try:
                setattr(args, name, parse_bytes(value))
            except ValueError:
                p.error(f"--{name.replace('_', '-')} expects a size like 256MiB, got {value!r}")
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be positive, got {value!r}")
    if args.input is not None and not args.input.exists() and args.make is None:
        p.error(f"{args.input} does not exist; pass --make SIZE to create it")
    if args.input is not None and args.output is not None:
        if args.output.resolve() == args.input.resolve():
            p.error(f"the output must not be the input, got {args.output} for both")
    for name in ("workers", "threads", "repeat"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.sigma <= 0:
        p.error(f"--sigma must be > 0, got {args.sigma}")
    return args


@contextlib.contextmanager
def stores(args: argparse.Namespace) -> Iterator[argparse.Namespace]:
    """``args`` with the stores not named placed in ``--workdir``, or in a temporary folder
    that is removed at the end (so nothing is written where the example is run from)."""
    if args.input is not None and args.output is not None:
        yield args
        return
    temporary = args.workdir is None
    folder = Path(tempfile.mkdtemp(prefix="zarr_pipeline-")) if temporary else args.workdir
    folder.mkdir(parents=True, exist_ok=True)
    args.input = args.input or folder / "in.zarr"
    args.output = args.output or folder / "out.zarr"
    kept = "temporary, removed at the end; --workdir DIR keeps them" if temporary else "kept"
    print(f"stores in {folder} ({kept})")
    try:
        yield args
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


def compare(a_path: Path, b_path: Path, gpu: bool) -> tuple[bool, float]:
    """Whether two stores hold the same values (exactly on the CPU; on the GPU to 1e-6,
    since the two paths run the filter's kernels on blocks of other shapes), and the
    largest absolute difference."""
    import dask.array as da

    a, b = da.from_zarr(str(a_path)), da.from_zarr(str(b_path))
    tol = 1e-6 if gpu else 0.0
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, math.inf
    same, diff = da.compute(da.allclose(a, b, rtol=tol, atol=tol), abs(a - b).max())
    return bool(same), float(diff)


def open_input(args: argparse.Namespace) -> tuple[Any, str]:
    """The input store (made if missing) as a Zarr array, and its codecs."""
    import zarr

    if args.input.exists():
        if args.make is not None:
            print(f"{args.input} exists: using it as it is (--make applies to a new store)")
    else:
        print(f"making {args.input}: {format_bytes(args.make)} of float32 images")
        make_input(args.input, args.make, args.image, args.chunk, args.store_chunk, args.codec)
    z = zarr.open_array(str(args.input), mode="r")
    if z.ndim != 3 or 0 in z.shape:
        print(
            f"zarr_pipeline: error: {args.input} must be a 3-D store of images (images, "
            f"height, width), none of them 0; got shape {z.shape}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    codecs = ", ".join(type(k).__name__ for k in z.compressors) or "uncompressed"
    return z, codecs


def as_dask(z: Any, args: argparse.Namespace, run: int) -> Any:
    """The input store as a Dask array in chunks of ``--chunk`` whole images, its keys
    named for run ``run`` (so that no run reuses what another computed)."""
    import dask.array as da
    from dask.base import tokenize

    image_bytes = math.prod(z.shape[1:]) * z.dtype.itemsize
    chunks = (images_per(args.chunk, image_bytes), *z.shape[1:])
    name = f"zarr-input-run{run}-{tokenize(str(args.input), chunks)}"
    return da.from_zarr(z, chunks=chunks, name=name)


def pipelines(x: Any, args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """What each pipeline writes, by label (of ``x``, the input under keys of one run's
    own, so each pipeline's keys are that run's too)."""
    import dask_overlap

    y = dask_overlap.map_blocks(smooth, x, sigma=args.sigma, dtype=x.dtype, split_axis=0)
    arrays = {"dask_overlap": y}
    if args.compare:
        arrays["plain"] = plain_dask(x, args.sigma, gpu)
        arrays["io_only"] = x
    return arrays


def run(client: Any, args: argparse.Namespace, gpu: bool, warm_chunks: int) -> dict[str, Any]:
    """Both pipelines (or ours alone) on the cluster, ``--repeat`` times: their seconds
    (medians, and run by run), and the comparison of the last run's outputs."""
    import dask.array as da

    import dask_overlap

    z, codecs = open_input(args)
    x = as_dask(z, args, 0)
    image_bytes = x.nbytes // x.shape[0]
    print(
        f"input: {x.shape} {x.dtype}, {format_bytes(x.nbytes)} in {x.numblocks[0]} chunks of "
        f"{format_bytes(image_bytes * x.chunks[0][0])} (on disk: "
        f"{format_bytes(image_bytes * z.chunks[0])} chunks, {codecs})"
    )
    disk = images_per(args.store_chunk, image_bytes)
    print(f"output: {args.codec}, {store_chunk(x.chunks[0][0], disk)} images a chunk on disk")
    outputs = {"dask_overlap": args.output}
    if args.compare:
        plain = args.output.with_name(f"{args.output.stem}-plain-dask{args.output.suffix}")
        copy = args.output.with_name(f"{args.output.stem}-io-only{args.output.suffix}")
        outputs.update(plain=plain, io_only=copy)
    # Untimed warm-up, a chunk per task thread: kernels compiled, pools allocated.
    warm = min(x.numblocks[0], warm_chunks) * x.chunks[0][0]
    da.compute(*(arr[:warm].sum(dtype="f8") for arr in pipelines(x, args, gpu).values()))
    runs: dict[str, list[float]] = {label: [] for label in outputs}
    for i in range(1, args.repeat + 1):
        arrays = pipelines(as_dask(z, args, i), args, gpu)
        # The two pipelines take turns at going first (the ceiling's run goes last).
        order = list(outputs) if i % 2 else ["plain", "dask_overlap", "io_only"][: len(outputs)]
        for label in order:
            out = outputs[label]
            print(f"{label}: {args.input} -> {out}" + (f" (run {i})" if args.repeat > 1 else ""))
            runs[label].append(run_pipeline(client, arrays[label], out, args.codec, disk))
            print(f"{label}: written in {runs[label][-1]:.2f} s")
    seconds = {label: statistics.median(r) for label, r in runs.items()}
    stats = client.run(dask_overlap.runtime_stats)
    result = {
        "device": next(iter(client.run(device_name, gpu).values())),
        "backend": sorted({s["backend"] for s in stats.values()}),
        "shape": list(x.shape),
        "dtype": str(x.dtype),
        "input_bytes": int(x.nbytes),
        "chunk_bytes": int(x.chunks[0][0] * image_bytes),
        "input_codecs": codecs,
        "output_codec": args.codec,
        "sigma": args.sigma,
        "repeat": args.repeat,
        "runs": runs,
        "seconds": seconds,
        "gbps": {k: x.nbytes / s / 1e9 for k, s in seconds.items()},
    }
    if args.compare:
        result["equal"], result["max_abs_diff"] = compare(args.output, outputs["plain"], gpu)
        shutil.rmtree(outputs["io_only"], ignore_errors=True)  # a copy of the input
    return result


def report(result: dict[str, Any], gpu: bool) -> None:
    """Print the figures (and the ratio, when both pipelines ran)."""
    gbps, seconds = result["gbps"], result["seconds"]
    if result["repeat"] > 1:
        print(f"(each figure the median of {result['repeat']} runs)")
    print(
        f"backend {', '.join(result['backend'])}, {result['workers']} worker(s) x "
        f"{result['threads_per_worker']} threads, device: {result['device']}"
    )
    print(
        f"throughput (read -> filter -> write): dask_overlap {gbps['dask_overlap']:.2f} GB/s "
        f"({format_bytes(result['input_bytes'])} in {seconds['dask_overlap']:.2f} s)"
    )
    if "plain" in gbps:
        result["ratio"] = gbps["dask_overlap"] / gbps["plain"]
        result["plain"] = "plain Dask + CuPy" if gpu else "plain Dask (NumPy/SciPy)"
        print(
            f"throughput (read -> filter -> write): {result['plain']} {gbps['plain']:.2f} GB/s "
            f"({seconds['plain']:.2f} s); dask_overlap / plain: {result['ratio']:.2f}x"
        )
        if result["repeat"] > 1:
            runs = result["runs"]
            each = (p / o for p, o in zip(runs["plain"], runs["dask_overlap"], strict=True))
            print(f"dask_overlap / plain, run by run: {', '.join(f'{r:.2f}' for r in each)}")
        print(f"outputs equal: {result['equal']} (largest difference {result['max_abs_diff']:.3g})")
    if "io_only" in gbps:
        io = gbps["io_only"]
        result["of_io_ceiling"] = {k: gbps[k] / io for k in ("dask_overlap", "plain")}
        print(
            f"read -> write with no filter (the storage's ceiling): {io:.2f} GB/s; "
            f"dask_overlap at {result['of_io_ceiling']['dask_overlap']:.2f} of it, "
            f"plain at {result['of_io_ceiling']['plain']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the pipeline; the exit status (1 when ``--compare`` finds the outputs differ)."""
    args = parse_args(argv)

    from distributed import Client

    from dask_overlap import LocalGPUCluster, Options
    from dask_overlap.cluster.local import plan_workers

    try:
        options = Options.from_config(backend=args.backend)
        layout = plan_workers(args.workers, allow_cpu=True, options=options)
    except (ValueError, ImportError) as e:
        print(f"zarr_pipeline: error: {e}", file=sys.stderr)
        return 2
    gpu = layout.options.backend == "cuda"
    with (
        stores(args),
        LocalGPUCluster(
            n_workers=layout.n_workers,
            threads_per_worker=args.threads,
            allow_cpu=True,
            options=layout.options,
        ) as cluster,
        Client(cluster) as client,
    ):
        print(f"dashboard: {cluster.dashboard_link}")
        threads = max(client.nthreads().values())
        result = run(client, args, gpu, warm_chunks=sum(client.nthreads().values()))
    result.update(workers=layout.n_workers, threads_per_worker=threads)
    report(result, gpu)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("equal", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
