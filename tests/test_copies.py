"""The copy threads: a copy is cut for the threads idle when it arrives."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dask_overlap.pipeline.copies import Copier

MiB = 1 << 20


def test_an_idle_pool_cuts_a_copy_for_every_thread_and_the_caller_takes_one():
    copier = Copier(4, "test-copy")
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def fn(src: np.ndarray, dst: np.ndarray) -> None:
        with lock:
            seen.append((src.nbytes, threading.current_thread().name))
        np.copyto(dst, src)

    src = np.arange(8 * MiB // 8, dtype=np.float64).reshape(1024, -1)
    dst = np.empty_like(src)
    copier.run([(src, dst)], fn)
    np.testing.assert_array_equal(dst, src)
    assert sorted(n for n, _ in seen) == [2 * MiB] * 4
    assert sum(name.startswith("test-copy") for _, name in seen) == 3
    copier.close()


def test_a_busy_pool_gets_fewer_larger_pieces():
    copier = Copier(4, "test-copy")
    release = threading.Event()
    started = threading.Semaphore(0)

    def stuck(src: np.ndarray, dst: np.ndarray) -> None:
        started.release()
        release.wait(10)

    big = np.zeros((1024, 1024))  # 8 MiB
    finished = threading.Event()
    copier.copy([(big, np.empty_like(big))], stuck, lambda error: finished.set())
    for _ in range(4):  # every thread holds a piece
        assert started.acquire(timeout=10)
    sizes: list[int] = []
    copier.run([(big, np.empty_like(big))], lambda s, d: sizes.append(s.nbytes))
    assert sizes == [big.nbytes]  # no idle thread: one piece, on this thread
    release.set()
    assert finished.wait(10)
    copier.close()


def test_the_first_error_of_a_waited_copy_is_raised_after_every_piece_is_done():
    copier = Copier(4, "test-copy")
    done: list[int] = []

    def fn(src: np.ndarray, dst: np.ndarray) -> None:
        if src[0, 0] == 0:
            raise OSError("piece failed")
        done.append(1)

    src = np.arange(1024 * 1024, dtype=np.float64).reshape(1024, -1)  # 8 MiB, 4 pieces
    with pytest.raises(OSError, match="piece failed"):
        copier.run([(src, np.empty_like(src))], fn)
    assert len(done) == 3
    copier.close()


def test_nothing_to_copy_is_done_at_once():
    copier = Copier(2, "test-copy")
    calls: list[BaseException | None] = []
    empty = np.empty((0, 4))
    copier.copy([(empty, empty.copy())], np.copyto, calls.append)
    assert calls == [None]
    copier.run([], np.copyto)
    copier.close()
