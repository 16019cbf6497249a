"""A filter with halos: ``dask_overlap.map_overlap`` against the ways users have today.

A float32 volume of planes of 512 x 512 (``--size``, in blocks of ``--block`` along axis
0), pageable, the threaded scheduler, no ``overlap.*`` settings, a Gaussian filter of
sigma 2 (a halo of 8 planes along axis 0; cupyx.scipy.ndimage on the GPU, scipy.ndimage
on the host backends), boundary ``reflect``, every figure until every output chunk
exists, GB/s of input. In one run, on the same data:

- ``naive``: ``da.map_overlap`` with a CuPy round trip per block;
- ``overlap_then_map_blocks``: ``da.overlap.overlap`` (padded blocks built on the host),
  ``dask_overlap.map_blocks``, ``da.overlap.trim_internal``;
- ``map_overlap``: ``dask_overlap.map_overlap`` (core and edge slabs into one device
  buffer, the boundary and the trim on the device);
- ``no_halo``: the same filter through ``dask_overlap.map_blocks`` with no halo (wrong
  at block edges, the same work): the ceiling ``map_overlap`` is measured against;
- ``edges_made``: each block its own ``dask_overlap.map_overlap`` call, joined by
  ``da.concatenate``: the same padded blocks filtered and trimmed on the device, but every
  edge made there by the boundary instead of copied in (wrong at block edges). It is the
  ceiling of reusing edges already on the device for the next partition: with every edge
  free, ``edge_reuse_ceiling`` (``edges_made`` over ``map_overlap``) is the most such
  reuse could bring, and ``edge_bytes_share`` the share of copied bytes that are edges.

Every boundary mode (``reflect``, ``periodic``, ``nearest``, ``none``, a constant) is
checked against ``da.map_overlap`` with the same function on a small volume
(``boundaries_checked``); ``correct`` says those and the timed run agreed.

Example::

    python benchmarks/bench_halo.py --size 4GiB --block 256MiB --record
"""

from __future__ import annotations

import os
import sys
from typing import Any

import dask
import dask.array as da
import numpy as np

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    GB,
    add_backend,
    add_output,
    add_repeat,
    best_of,
    byte_count,
    device_name,
    naive_block,
    parser,
    persist_chunks,
    save,
)

BENCHMARK = "halo"
PLANE = (512, 512)
SIGMA = 2.0  # with scipy's truncate of 4: a radius of 8
DEPTH = {0: 8, 1: 0, 2: 0}
BOUNDARIES = ("reflect", "periodic", "nearest", "none", 0.0)


def gaussian(b: Any) -> Any:
    """The filter, on the array module of ``b``."""
    if type(b).__module__.startswith("cupy"):
        from cupyx.scipy import ndimage
    else:
        from scipy import ndimage
    return ndimage.gaussian_filter(b, SIGMA)


def volume(planes: int, plane: tuple[int, int]) -> np.ndarray:
    """Float32 random planes in ordinary memory (the same for the same shape)."""
    out = np.empty((planes, *plane), np.float32)
    np.random.default_rng(0).random(out=out.reshape(planes, -1), dtype=np.float32)
    return out


def paths(x: da.Array, backend: str, boundary: Any) -> dict[str, da.Array]:
    """Every path's array, by name (see the module docstring)."""
    kw = {"depth": DEPTH, "boundary": boundary}
    padded = da.overlap.overlap(x, **kw)
    by_blocks = dask_overlap.map_blocks(gaussian, padded, dtype=np.float32)
    return {
        "naive": da.map_overlap(naive_block, x, kernel=gaussian, backend=backend, **kw),
        "overlap_then_map_blocks": da.overlap.trim_internal(by_blocks, DEPTH, boundary),
        "map_overlap": dask_overlap.map_overlap(gaussian, x, dtype=np.float32, **kw),
        "no_halo": dask_overlap.map_blocks(gaussian, x, dtype=np.float32),
        "edges_made": da.concatenate(
            [
                dask_overlap.map_overlap(gaussian, x.blocks[i], dtype=np.float32, **kw)
                for i in range(x.numblocks[0])
            ]
        ),
    }


def close(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Block by block, to float32 rounding (the same kernel on the same data)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and np.allclose(x, y, rtol=1e-5, atol=1e-5)
        for x, y in zip(map(np.asarray, a), map(np.asarray, b), strict=True)
    )


def check_boundaries(backend: str, plane: tuple[int, int]) -> list[str]:
    """The boundary modes whose ``map_overlap`` agrees with ``da.map_overlap``."""
    x = da.from_array(volume(64, plane), chunks=(16, *plane))
    ok = []
    for boundary in BOUNDARIES:
        arrays = paths(x, backend, boundary)
        ours = dask.compute(*arrays["map_overlap"].to_delayed().ravel())
        theirs = dask.compute(*arrays["naive"].to_delayed().ravel())
        if close(list(ours), list(theirs)):
            ok.append(str(boundary))
    return ok


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="4GiB", help="input bytes (float32)")
    p.add_argument("--block", type=byte_count, default="256MiB", help="bytes per input block")
    p.add_argument("--plane", type=int, default=PLANE[0], help="planes are N x N [512]")
    add_backend(p)
    add_repeat(p, 2)
    add_output(p)
    args = p.parse_args(argv)
    dask.config.set({"overlap.backend": args.backend})
    plane = (args.plane, args.plane)
    plane_bytes = 4 * plane[0] * plane[1]
    per_block = max(DEPTH[0], args.block // plane_bytes)
    planes = max(2 * per_block, args.size // plane_bytes // per_block * per_block)
    host = volume(planes, plane)
    x = da.from_array(host, chunks=(per_block, *plane))
    backend = dask_overlap.get_runtime().name
    boundaries = check_boundaries(backend, plane)
    seconds, got = {}, {}
    for name, arr in paths(x, backend, "reflect").items():
        print(f"  running {name}", flush=True)
        dask.persist(arr[: 2 * per_block])  # warm-up: kernels, pools, first touch
        seconds[name], got[name] = best_of(lambda a=arr: persist_chunks(a), args.repeat)
    gbps = {name: host.nbytes / s / GB for name, s in seconds.items()}
    d = DEPTH[0]  # away from block edges, the edges made there change nothing
    inner = [b[d:-d] for b in got["map_overlap"]]
    correct = (
        close(got["map_overlap"], got["naive"])
        and close([b[d:-d] for b in got["edges_made"]], inner)
        and close(got["overlap_then_map_blocks"], got["naive"])
        and boundaries == [str(b) for b in BOUNDARIES]
    )
    result = {
        "device": device_name(backend),
        "size_bytes": host.nbytes,
        "block_bytes": per_block * plane_bytes,
        "depth": DEPTH[0],
        **{f"{name}_gbps": v for name, v in gbps.items()},
        "map_overlap_over_no_halo": gbps["map_overlap"] / gbps["no_halo"],
        "speedup_vs_naive": gbps["map_overlap"] / gbps["naive"],
        "edge_reuse_ceiling": gbps["edges_made"] / gbps["map_overlap"],
        "edge_bytes_share": 2 * DEPTH[0] / (per_block + 2 * DEPTH[0]),
        "boundaries_checked": boundaries,
        "correct": correct,
    }
    block = result["block_bytes"] / 2**20
    print(f"{result['device']}: {host.nbytes / 2**30:.2f} GiB float32 in blocks of "
          f"{block:.0f} MiB, gaussian sigma {SIGMA}, halo {DEPTH[0]}")  # fmt: skip
    for name, v in gbps.items():
        print(f"  {name:<24} {v:7.2f} GB/s")
    print(f"  map_overlap_over_no_halo: {result['map_overlap_over_no_halo']:.2f}; "
          f"speedup_vs_naive: {result['speedup_vs_naive']:.2f}")  # fmt: skip
    print(f"  edge_reuse_ceiling: {result['edge_reuse_ceiling']:.2f} (edges are "
          f"{result['edge_bytes_share']:.1%} of the bytes copied in)")  # fmt: skip
    print(f"  boundaries checked: {', '.join(boundaries)}; correct={correct}")
    save(args, BENCHMARK, result, result, result["device"])
    return result


if __name__ == "__main__":
    main()
