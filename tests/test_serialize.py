"""CuPy chunks over TCP through pinned memory (#16): :mod:`dask_overlap.cluster.serialize`.

On the CPU the serializers run as they do on a GPU worker, with a host runtime lending its
pool, streams and copy threads, for a stand-in "device" array: a NumPy array behind a
type of its own (:class:`StandIn`), registered for these tests only, with a pair written
as distributed's CuPy serializers are, NumPy for CuPy, in distributed's place. Nothing is
registered for ``numpy.ndarray``. Marked ``gpu``: real CuPy arrays, distributed's own
functions in both directions, and two workers of a ``LocalGPUCluster`` over TCP.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client
from distributed.protocol import deserialize, dumps, loads, serialize, to_serialize
from distributed.protocol.serialize import dask_deserialize, dask_serialize
from support import CLUSTER_KW, GPU_CONFIG, PLUGIN_OPTIONS

from dask_overlap import LocalGPUCluster, Options, Runtime, runtime_stats
from dask_overlap.cluster.serialize import PinnedSerializer, register, unregister

POOL = 1 << 20  # the host runtime's pool: blocks of up to half of it are lent
COUNTERS = (
    "serialized_pinned",
    "bytes_serialized_pinned",
    "serialize_fallbacks",
    "deserialized_pinned",
    "bytes_deserialized_pinned",
    "deserialize_fallbacks",
)


# -- the stand-in: a "device" array, and distributed's pair written for it ----------------
class StandIn:
    """A "device" array: a NumPy array behind a type of its own."""

    def __init__(self, a: np.ndarray):
        self.a = a

    @property
    def nbytes(self) -> int:
        return self.a.nbytes


def interface(a: np.ndarray) -> dict[str, Any]:
    """What CuPy's ``__cuda_array_interface__`` (version 3) says of an array like ``a``."""
    return {
        "shape": a.shape,
        "typestr": a.dtype.str,
        "descr": a.dtype.descr,
        "stream": 1,
        "version": 3,
        "strides": None if a.flags.c_contiguous else a.strides,
        "data": (a.ctypes.data if a.size else 0, False),
    }


def raw(a: np.ndarray) -> np.ndarray:
    """Contiguous ``a``'s bytes in memory order, not copied."""
    return a.ravel(order="K").view(np.uint8)


def view(buf: np.ndarray, header: dict[str, Any]) -> np.ndarray:
    return np.ndarray(
        shape=header["shape"], dtype=header["typestr"], buffer=buf, strides=header["strides"]
    )


def distributed_dumps(x: StandIn) -> tuple[dict[str, Any], list[Any]]:
    """``distributed.protocol.cupy.dask_serialize_cupy_ndarray``, NumPy for CuPy."""
    a = x.a
    if not (a.flags["C_CONTIGUOUS"] or a.flags["F_CONTIGUOUS"]):
        a = np.array(a, copy=True)
    header = interface(a)
    header["strides"] = tuple(a.strides)
    return header, [memoryview(raw(a).copy())]


def distributed_loads(header: dict[str, Any], frames: Sequence[Any]) -> StandIn:
    """``distributed.protocol.cupy.dask_deserialize_cupy_ndarray``, NumPy for CuPy."""
    (frame,) = frames
    return StandIn(view(np.frombuffer(frame, np.uint8).copy(), header))


class StandInArrays:
    """The serializers' :class:`~dask_overlap.cluster.serialize.DeviceArrays` for
    :class:`StandIn`."""

    array_type = StandIn

    def device_id(self, x: StandIn) -> int:
        return 0

    def current_device(self) -> int:
        return 0

    def header(self, x: StandIn) -> dict[str, Any]:
        header = interface(x.a)
        header["strides"] = tuple(x.a.strides)
        return header

    def to_host(self, stream: Any, x: StandIn, out: np.ndarray) -> StandIn:
        def copy() -> StandIn:
            a = x.a
            if not (a.flags.c_contiguous or a.flags.f_contiguous):
                a = np.array(a, copy=True)
            np.copyto(out, raw(a))
            return StandIn(a)

        return stream.run(copy)

    def to_device(self, stream: Any, src: np.ndarray, header: dict[str, Any]) -> StandIn:
        buf = np.empty(src.nbytes, np.uint8)
        stream.run(lambda: np.copyto(buf, src))
        return StandIn(view(buf, header))

    pageable_dumps = staticmethod(distributed_dumps)
    pageable_loads = staticmethod(distributed_loads)


TOPLEVEL = StandIn.__module__.partition(".")[0]


@pytest.fixture
def distributed_lazy() -> Iterator[list[str]]:
    """Distributed's pair for :class:`StandIn`, registered lazily as distributed registers
    CuPy's (on the first dispatch of a type of the module); the list records each firing.
    Everything registered for StandIn is gone afterwards."""
    fired: list[str] = []

    def hook() -> None:
        fired.append("fired")
        if len(fired) > 1:
            return  # as an import: the module's body, which registers, runs once
        dask_serialize.register(StandIn, distributed_dumps)
        dask_deserialize.register(StandIn, distributed_loads)

    dask_serialize.register_lazy(TOPLEVEL, hook)
    dask_deserialize.register_lazy(TOPLEVEL, hook)
    try:
        yield fired
    finally:
        unregister(StandIn)
        for dispatch in (dask_serialize, dask_deserialize):
            dispatch._lazy.pop(TOPLEVEL, None)
            dispatch._lookup.pop(StandIn, None)


def host_runtime(**options: Any) -> Runtime:
    return Runtime(
        Options.from_config(
            backend="host", pinned_pool_size=POOL, streams=2, staging_threads=2, **options
        )
    )


@pytest.fixture
def rt() -> Iterator[Runtime]:
    runtime = host_runtime()
    yield runtime
    runtime.close()


@pytest.fixture
def ours(rt: Runtime, distributed_lazy: list[str]) -> PinnedSerializer:
    serializer = register(rt, StandInArrays())
    assert serializer is not None
    return serializer


def counts(rt: Runtime) -> dict[str, int]:
    stats = rt.stats()
    return {k: stats[k] for k in COUNTERS}


LAYOUTS = {
    "C": lambda: np.arange(6 * 40, dtype=np.float32).reshape(6, 40) * 0.5,
    "F": lambda: np.asfortranarray(np.arange(6 * 40, dtype=np.float64).reshape(6, 40)),
    "strided": lambda: np.arange(8 * 30, dtype=np.int16).reshape(8, 30)[1::2, ::3],
    "transposed-strided": lambda: np.arange(64 * 9, dtype=np.int32).reshape(64, 9)[::2].T,
    "0-d": lambda: np.array(7.25, dtype=np.float64),
    "empty": lambda: np.empty((0, 5), dtype=np.float32),
    "3-d": lambda: np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
}


def check_same(got: Any, a: np.ndarray) -> None:
    assert isinstance(got, StandIn)
    assert got.a.shape == a.shape and got.a.dtype == a.dtype
    np.testing.assert_array_equal(got.a, a)
    if a.flags.c_contiguous or a.flags.f_contiguous:
        assert got.a.strides == a.strides  # the layout too, not only the values


# -- round trips -------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_serialize_and_deserialize(rt, ours, layout) -> None:
    a = LAYOUTS[layout]()
    header, frames = serialize(StandIn(a), serializers=("dask",), on_error="raise")
    assert header["serializer"] == "dask" and len(frames) == 1
    assert frames[0].nbytes == a.nbytes
    check_same(deserialize(header, frames), a)
    assert counts(rt) == {
        "serialized_pinned": 1,
        "bytes_serialized_pinned": a.nbytes,
        "serialize_fallbacks": 0,
        "deserialized_pinned": 1,
        "bytes_deserialized_pinned": a.nbytes,
        "deserialize_fallbacks": 0,
    }


def test_a_message_through_dumps_and_loads(rt, ours) -> None:
    """As a comm sends it: in a message, the frame cut into shards and merged again."""
    a = np.arange(1 << 15, dtype=np.float32).reshape(128, 256)  # 128 KiB
    b = np.asfortranarray(a[:100] * 3)  # 100 KiB: with a's, and a block to load into, lent
    msg = {"op": "get-data", "data": {"x": to_serialize(StandIn(a)), "y": to_serialize(StandIn(b))}}
    frames = dumps(msg, frame_split_size=1 << 15)
    assert sum(isinstance(f, memoryview) for f in frames) == 4 + 4  # 32 KiB slices of each
    assert rt.backend.pinned.in_use == a.nbytes + b.nbytes  # the frames hold the blocks
    got = loads(frames)
    check_same(got["data"]["x"], a)
    check_same(got["data"]["y"], b)
    assert got["op"] == "get-data"
    del frames
    assert rt.backend.pinned.in_use == 0  # the results hold no block
    assert counts(rt)["bytes_serialized_pinned"] == a.nbytes + b.nbytes
    assert counts(rt)["deserialized_pinned"] == 2


# -- lifetime and bounds ------------------------------------------------------------------
def test_the_block_goes_back_once_every_frame_and_slice_is_dropped(rt, ours) -> None:
    a = np.arange(4096, dtype=np.float64)  # 32 KiB
    pool = rt.backend.pinned
    header, frames = ours.dumps(StandIn(a))
    assert pool.in_use == a.nbytes and pool.held == a.nbytes
    shard = frames[0][: a.nbytes // 2]  # distributed cuts large frames into such slices
    del frames
    assert pool.in_use == a.nbytes  # a slice still holds it
    assert bytes(shard) == raw(a)[: a.nbytes // 2].tobytes()
    del shard
    assert pool.in_use == 0 and pool.held == 0


def test_no_room_in_the_pool_takes_distributeds_path_counted(rt, ours) -> None:
    pool = rt.backend.pinned
    a = np.arange(8192, dtype=np.float32).reshape(64, 128)  # 32 KiB
    keep = pool.allocate(pool.hold_limit)  # every byte that may be lent
    assert keep is not None
    header, frames = serialize(StandIn(a), serializers=("dask",), on_error="raise")
    check_same(deserialize(header, frames), a)
    assert counts(rt) == dict.fromkeys(COUNTERS, 0) | {
        "serialize_fallbacks": 1,
        "deserialize_fallbacks": 1,
    }
    assert pool.in_use == pool.hold_limit  # nothing more was taken
    big = np.zeros(pool.hold_limit // 8 + 1)  # larger than may ever be lent
    del keep
    check_same(deserialize(*serialize(StandIn(big), serializers=("dask",))), big)
    check_same(deserialize(*serialize(StandIn(a), serializers=("dask",))), a)
    assert counts(rt)["serialize_fallbacks"] == 2 and counts(rt)["serialized_pinned"] == 1
    assert pool.in_use == 0


def test_a_closed_runtime_lends_nothing(rt, ours) -> None:
    rt.close()
    a = np.arange(100.0)
    header, frames = ours.dumps(StandIn(a))
    check_same(ours.loads(header, frames), a)
    assert counts(rt) == dict.fromkeys(COUNTERS, 0)  # distributed's path: nothing lent


def test_without_a_lender_distributeds_path(distributed_lazy) -> None:
    ours = register(None, StandInArrays())
    assert ours is not None and ours.lender(0) is None
    a = LAYOUTS["strided"]()
    header, frames = serialize(StandIn(a), serializers=("dask",), on_error="raise")
    expected_header, expected_frames = distributed_dumps(StandIn(a))
    assert header["sub-header"]["strides"] == expected_header["strides"]
    assert bytes(frames[0]) == bytes(expected_frames[0])
    check_same(deserialize(header, frames), a)


def test_a_frame_of_the_wrong_size_is_refused(rt, ours) -> None:
    header, frames = ours.dumps(StandIn(np.arange(10.0)))
    with pytest.raises(ValueError, match=r"shape \(10,\): expected 80 bytes, got 72"):
        ours.loads(header, [frames[0][:72]])


# -- distributed's layout, both ways ------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layout_is_distributeds(rt, ours, layout) -> None:
    a = LAYOUTS[layout]()
    header, frames = ours.dumps(StandIn(a))
    theirs_header, theirs_frames = distributed_dumps(StandIn(a))
    assert header.keys() == theirs_header.keys()
    for key in header.keys() - {"data"}:  # the device pointer is the sender's own
        assert header[key] == theirs_header[key], key
    assert [bytes(f) for f in frames] == [bytes(f) for f in theirs_frames]
    # Each side reads what the other wrote.
    check_same(distributed_loads(header, frames), a)
    check_same(ours.loads(theirs_header, theirs_frames), a)
    assert counts(rt)["deserialized_pinned"] == 1


def test_registered_after_distributeds_lazy_registration(rt, distributed_lazy) -> None:
    assert distributed_lazy == []  # not fired yet: nothing dispatched StandIn
    ours = register(rt, StandInArrays())
    assert distributed_lazy == ["fired"]  # fired first, before ours went in
    assert dask_serialize.dispatch(StandIn) == ours.dumps
    assert dask_deserialize.dispatch(StandIn) == ours.loads

    class Later:  # another type of the same module: what fires the hook left behind
        pass

    with pytest.raises(TypeError):
        dask_deserialize.dispatch(Later)
    assert distributed_lazy == ["fired", "fired"]
    assert dask_serialize.dispatch(StandIn) == ours.dumps  # ours still
    assert dask_deserialize.dispatch(StandIn) == ours.loads
    assert ours.previous == (distributed_dumps, distributed_loads)
    # Registering again (another worker's runtime, a second setup) keeps distributed's pair
    # as the fallback, never ours: the full pool's path still ends in distributed's.
    again = register(rt, StandInArrays())
    assert again is ours
    keep = rt.backend.pinned.allocate(rt.backend.pinned.hold_limit)
    a = LAYOUTS["F"]()
    check_same(deserialize(*serialize(StandIn(a), serializers=("dask",))), a)
    assert counts(rt)["serialize_fallbacks"] == 1
    del keep


def test_distributeds_pair_registered_again_becomes_the_fallback(rt, ours) -> None:
    """As when ``distributed.protocol.cupy`` imports after ours (it could not before)."""

    def newer_dumps(x: StandIn) -> tuple[dict[str, Any], list[Any]]:
        return distributed_dumps(x)

    dask_serialize.register(StandIn, newer_dumps)
    again = register(rt, StandInArrays())
    assert again is not ours and again.previous == (newer_dumps, distributed_loads)
    assert dask_serialize.dispatch(StandIn) == again.dumps


# -- the switch --------------------------------------------------------------------------
def test_the_switch_off_leaves_distributeds_serializers(distributed_lazy) -> None:
    with dask.config.set({"overlap.pinned-serialize": False}):
        off = host_runtime()
        assert off.options.pinned_serialize is False
        assert register(off, StandInArrays()) is None
        assert register(None, StandInArrays()) is None
    try:
        assert dask_serialize.dispatch(StandIn) is distributed_dumps
        assert dask_deserialize.dispatch(StandIn) is distributed_loads
        a = LAYOUTS["C"]()
        header, frames = serialize(StandIn(a), serializers=("dask",), on_error="raise")
        check_same(deserialize(header, frames), a)
        assert counts(off) == dict.fromkeys(COUNTERS, 0) and off.backend.pinned.allocations == 0
    finally:
        off.close()


def test_turning_it_off_puts_distributeds_back(rt, ours) -> None:
    assert dask_serialize.dispatch(StandIn) == ours.dumps
    off = host_runtime(pinned_serialize=False)
    try:
        assert register(off, StandInArrays()) is None
        assert dask_serialize.dispatch(StandIn) is distributed_dumps
        assert dask_deserialize.dispatch(StandIn) is distributed_loads
        assert ours.lender(0) is None  # its lenders are forgotten too
    finally:
        off.close()


def test_unregister_with_nothing_before_removes_ours(rt) -> None:
    try:
        ours = register(rt, StandInArrays())
        assert ours.previous == (None, None)  # nothing registered: the stand-in's own path
        assert dask_serialize.dispatch(StandIn) == ours.dumps
        unregister(StandIn)
        with pytest.raises(TypeError):
            dask_serialize.dispatch(StandIn)
    finally:
        for dispatch in (dask_serialize, dask_deserialize):
            dispatch._lookup.pop(StandIn, None)


def test_the_option_reads_the_environment_form(monkeypatch) -> None:
    assert Options.from_config().pinned_serialize is True
    with dask.config.set({"overlap.pinned-serialize": "false"}):
        assert Options.from_config().pinned_serialize is False
    with pytest.raises(ValueError, match="pinned_serialize must be true or false, got 'maybe'"):
        Options.from_config(pinned_serialize="maybe")


def test_without_cupy_register_does_nothing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert register() is None
    unregister()  # nothing to put back


# -- on the GPU ---------------------------------------------------------------------------
GPU_LAYOUTS = ("C", "F", "strided", "transposed-strided", "0-d", "empty", "3-d")


def cupy_array(layout: str) -> Any:
    """:data:`LAYOUTS`'s array on the GPU, made there in the same layout."""
    import cupy as cp

    if layout == "strided":
        return cp.arange(8 * 30, dtype=cp.int16).reshape(8, 30)[1::2, ::3]
    if layout == "transposed-strided":
        return cp.arange(64 * 9, dtype=cp.int32).reshape(64, 9)[::2].T
    a = cp.asarray(LAYOUTS[layout]())
    return cp.asfortranarray(a) if layout == "F" else a


@pytest.fixture
def cuda_rt() -> Iterator[Runtime]:
    with dask.config.set(GPU_CONFIG):
        runtime = Runtime(Options.from_config(backend="cuda"))
    yield runtime
    runtime.close()


def distributed_cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``distributed.protocol.cupy``. Without numba (the GPU machine has none) a stand-in
    numba is importable while it loads: its RMM module imports numba at the top, for a
    serializer these tests never call."""
    try:
        importlib.import_module("numba.cuda")
    except ImportError:
        numba = types.ModuleType("numba")
        numba.cuda = types.ModuleType("numba.cuda")  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "numba", numba)
        monkeypatch.setitem(sys.modules, "numba.cuda", numba.cuda)
    return importlib.import_module("distributed.protocol.cupy")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_round_trip(cuda_rt, layout) -> None:
    import cupy as cp

    ours = register(cuda_rt)
    x = cupy_array(layout)
    x *= 3  # queued on the legacy default stream just now: the D2H must wait for it
    header, frames = serialize(x, serializers=("dask",), on_error="raise")
    got = deserialize(header, frames)
    assert isinstance(got, cp.ndarray) and got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(x))
    if x.flags.c_contiguous or x.flags.f_contiguous:
        assert got.strides == x.strides
    assert ours is not None and dask_serialize.dispatch(cp.ndarray) == ours.dumps
    stats = counts(cuda_rt)
    assert stats["serialized_pinned"] == 1 and stats["bytes_serialized_pinned"] == x.nbytes
    assert stats["deserialized_pinned"] == 1 and stats["serialize_fallbacks"] == 0
    del frames
    assert cuda_rt.backend.pinned.in_use == 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_layout_is_distributeds_both_ways(cuda_rt, monkeypatch, layout) -> None:
    import cupy as cp

    theirs = distributed_cupy(monkeypatch)
    ours = register(cuda_rt)  # after theirs loaded: ours in place, theirs the fallback
    assert ours.previous == (
        theirs.dask_serialize_cupy_ndarray,
        theirs.dask_deserialize_cupy_ndarray,
    )
    x = cupy_array(layout)
    header, frames = ours.dumps(x)
    theirs_header, theirs_frames = theirs.dask_serialize_cupy_ndarray(x)
    assert header.keys() == theirs_header.keys()
    for key in header.keys() - {"data"}:
        assert header[key] == theirs_header[key], key
    assert [bytes(f) for f in frames] == [bytes(f) for f in theirs_frames]
    for got in (
        theirs.dask_deserialize_cupy_ndarray(header, frames),
        ours.loads(theirs_header, theirs_frames),
    ):
        assert isinstance(got, cp.ndarray) and got.shape == x.shape
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(x))
    assert counts(cuda_rt)["deserialized_pinned"] == 1


ROWS, COLS = 1024, 2048  # 8 MiB of float32


def gpu_block(layout: str) -> Any:
    """A CuPy block, made on the worker that runs it."""
    import cupy as cp

    a = cp.arange(ROWS * COLS, dtype=cp.float32).reshape(ROWS, COLS) * 0.5
    return {"C": a, "F": cp.asfortranarray(a), "strided": a[:, ::2]}[layout]


def expected_block(layout: str) -> np.ndarray:
    a = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) * 0.5
    return {"C": a, "F": np.asfortranarray(a), "strided": a[:, ::2]}[layout]


def to_numpy(block: Any) -> np.ndarray:
    """The block, copied to the host; only a CuPy array is accepted."""
    import cupy as cp

    if not isinstance(block, cp.ndarray):
        raise TypeError(f"expected a cupy.ndarray, got {type(block).__name__}")
    return cp.asnumpy(block)


@pytest.mark.gpu
def test_gpu_two_workers_over_tcp_send_through_pinned_memory() -> None:
    with (
        LocalGPUCluster(
            n_workers=2,
            threads_per_worker=2,
            protocol="tcp",
            **PLUGIN_OPTIONS["cuda"],
            **CLUSTER_KW,
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        a, b = sorted(client.scheduler_info()["workers"])
        assert a.startswith("tcp://") and b.startswith("tcp://")
        before = client.run(runtime_stats)
        assert {s["backend"] for s in before.values()} == {"cuda"}
        layouts = ("C", "F", "strided")
        made = {k: client.submit(gpu_block, k, workers=[a], pure=False) for k in layouts}
        moved = {k: client.submit(to_numpy, f, workers=[b], pure=False) for k, f in made.items()}
        for k in layouts:
            np.testing.assert_array_equal(moved[k].result(), expected_block(k))
        sent = sum(expected_block(k).nbytes for k in layouts)
        stats = client.run(runtime_stats)
        assert stats[a]["serialized_pinned"] >= len(layouts), stats[a]
        assert stats[a]["bytes_serialized_pinned"] >= sent, stats[a]
        assert stats[a]["serialize_fallbacks"] == 0, stats[a]
        assert stats[b]["deserialized_pinned"] >= len(layouts), stats[b]
        assert stats[b]["bytes_deserialized_pinned"] >= sent, stats[b]
        assert stats[b]["deserialize_fallbacks"] == 0, stats[b]
