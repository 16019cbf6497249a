"""A 3-D Gaussian and a gradient magnitude over a Zarr volume, with halos made on the GPU.

The volume, shape ``(z, y, x)`` float32, is read from a Zarr store in Dask chunks that
cut it along every axis; each chunk is filtered with its neighbours' edges (a halo of
``4 * sigma`` voxels, SciPy's reach) by ``dask_overlap.map_overlap``: each partition copies
its core and its neighbours' edge slabs into one device buffer, makes the volume's
boundary (``reflect``) there, filters, and copies back only its core. Two results are
written to Zarr stores, the smoothed volume (``cupyx.scipy.ndimage.gaussian_filter``)
and its edges (``gaussian_gradient_magnitude``); on the CPU path the same functions come
from ``scipy.ndimage``. They equal the filters of the whole volume.

``--compare`` runs the same with ``dask.array.map_overlap`` and the usual CuPy round trip
per block (on the CPU, SciPy), after an untimed warm-up of each, and compares the outputs.

    python examples/volume_filter.py --make 1GiB --chunks 128x256x256 --compare
    python examples/volume_filter.py in.zarr --sigma 1.5 --workdir /dev/shm/vf

Stores not named go to ``--workdir``, or to a temporary folder removed at the end:
nothing is written where it is run from. ``--make SIZE`` writes a synthetic volume of
planes of 512 x 512 when the input does not exist. ``--json PATH`` saves the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from dask.utils import parse_bytes


def ndimage_of(block: Any) -> Any:
    """cupyx's ndimage for a CuPy block, SciPy's for a NumPy one."""
    if type(block).__module__.split(".")[0] == "cupy":
        from cupyx.scipy import ndimage
    else:
        from scipy import ndimage
    return ndimage


def smooth(block: Any, sigma: float) -> Any:
    """A 3-D Gaussian of ``block``.

    Examples
    --------
    >>> smooth(np.ones((4, 4, 4), "f4"), 1.0).shape
    (4, 4, 4)
    """
    return ndimage_of(block).gaussian_filter(block, sigma, mode="reflect")


def edges(block: Any, sigma: float) -> Any:
    """The gradient magnitude of a 3-D Gaussian of ``block``."""
    return ndimage_of(block).gaussian_gradient_magnitude(block, sigma, mode="reflect")


def reach(sigma: float) -> int:
    """Voxels a Gaussian of ``sigma`` reads on each side (SciPy's truncate of 4)."""
    return int(4.0 * sigma + 0.5)


def round_trip(func: Any, sigma: float) -> Any:
    """``func`` the usual Dask + CuPy way: copy in, filter, copy out, per block."""

    def run(block: np.ndarray) -> np.ndarray:
        try:
            import cupy
        except ImportError:
            return func(block, sigma)
        if not cupy.cuda.is_available():
            return func(block, sigma)
        return cupy.asnumpy(func(cupy.asarray(block), sigma))

    return run


def shape_of(text: str) -> tuple[int, int, int]:
    parts = tuple(int(p) for p in text.lower().split("x"))
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected ZxYxX such as 128x256x256, got {text!r}")
    return parts  # type: ignore[return-value]


@contextlib.contextmanager
def workdir(folder: str | None) -> Iterator[Path]:
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        print(f"stores in {folder} (kept)")
        yield Path(folder)
        return
    with tempfile.TemporaryDirectory(prefix="volume-filter-") as tmp:
        print(f"stores in {tmp} (temporary, removed at the end)")
        yield Path(tmp)


def make_volume(path: Path, nbytes: int, chunks: tuple[int, int, int]) -> None:
    import zarr

    planes = max(1, nbytes // (4 * 512 * 512))
    out = zarr.create_array(str(path), shape=(planes, 512, 512), chunks=chunks, dtype="f4")
    rng = np.random.default_rng(0)
    for z in range(0, planes, chunks[0]):
        n = min(chunks[0], planes - z)
        base = rng.random((n, 512, 512), dtype=np.float32)
        out[z : z + n] = base + np.linspace(0, 1, 512, dtype=np.float32)  # some structure
    print(f"made {path.name}: {planes} planes of 512 x 512 float32")


def filtered(x: Any, sigma: float, ours: bool) -> list[Any]:
    """The two results, through dask_overlap (``ours``) or plain Dask."""
    import dask.array as da

    import dask_overlap

    depth, out = reach(sigma), []
    for func in (smooth, edges):
        if ours:
            out.append(
                dask_overlap.map_overlap(
                    func, x, depth=depth, boundary="reflect", sigma=sigma, dtype=np.float32
                )
            )
        else:
            f = round_trip(func, sigma)
            out.append(da.map_overlap(f, x, depth=depth, boundary="reflect", dtype=np.float32))
    return out


def run(x: Any, where: Path, names: list[str], sigma: float, ours: bool) -> float:
    """Seconds to filter ``x`` and write both results (after a warm-up of the first
    chunk's worth, not timed)."""
    import dask.array as da
    import zarr

    head = x[tuple(slice(0, c[0]) for c in x.chunks)]
    da.compute(*filtered(head, sigma, ours))  # warm-up: kernels, pools
    targets = [
        zarr.create_array(str(where / n), shape=x.shape, chunks=x.chunksize, dtype="f4",
                          overwrite=True)
        for n in names
    ]  # fmt: skip
    t0 = time.perf_counter()
    da.store(filtered(x, sigma, ours), targets, lock=False)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", nargs="?", default="volume.zarr", help="[volume.zarr]")
    p.add_argument("--make", type=parse_bytes, default=None, help="write a volume this size")
    p.add_argument("--chunks", type=shape_of, default=(64, 256, 256), help="Dask chunks")
    p.add_argument("--sigma", type=float, default=2.0, help="[2.0]")
    p.add_argument("--compare", action="store_true", help="also run plain Dask and compare")
    p.add_argument("--workdir", default=None, help="where unnamed stores go")
    p.add_argument("--json", default=None, help="save the figures here")
    args = p.parse_args(argv)
    try:
        import dask.array as da
        import zarr
    except ImportError as e:
        p.exit(2, f"volume_filter.py needs zarr ({e}): pip install zarr\n")
    with workdir(args.workdir) as where:
        source = Path(args.input) if Path(args.input).is_absolute() else where / args.input
        if not source.exists():
            if args.make is None:
                p.exit(2, f"{args.input} does not exist; pass --make SIZE to create it\n")
            make_volume(source, args.make, args.chunks)
        x = da.from_zarr(str(source)).rechunk(args.chunks)
        ours = run(x, where, ["smooth.zarr", "edges.zarr"], args.sigma, ours=True)
        result: dict[str, Any] = {"shape": list(x.shape), "chunks": list(x.chunksize),
                                  "sigma": args.sigma, "halo": reach(args.sigma),
                                  "dask_overlap_gbps": x.nbytes / ours / 1e9}  # fmt: skip
        print(f"{x.nbytes / 2**30:.2f} GiB in chunks of {x.chunksize}, halo {reach(args.sigma)}: "
              f"dask_overlap {result['dask_overlap_gbps']:.2f} GB/s")  # fmt: skip
        if args.compare:
            plain = run(x, where, ["smooth-plain.zarr", "edges-plain.zarr"], args.sigma, False)
            result["plain_gbps"] = x.nbytes / plain / 1e9
            result["speedup"] = plain / ours
            pairs = (("smooth.zarr", "smooth-plain.zarr"), ("edges.zarr", "edges-plain.zarr"))
            equal = all(
                np.allclose(zarr.open_array(str(where / a))[:], zarr.open_array(str(where / b))[:],
                            rtol=1e-5, atol=1e-5)
                for a, b in pairs
            )  # fmt: skip
            result["equal"] = equal
            print(f"plain da.map_overlap {result['plain_gbps']:.2f} GB/s "
                  f"({result['speedup']:.2f}x); outputs equal: {equal}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
