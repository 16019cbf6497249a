"""The engine driven directly: no threads, no backend, no Dask."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dask_overlap.engine import (
    Action,
    Done,
    EngineError,
    Failed,
    Pipeline,
    Stage,
    plan_sub_chunks,
)

ORDER = [Stage.STAGE, Stage.H2D, Stage.COMPUTE, Stage.D2H]


# -- plan_sub_chunks --------------------------------------------------------------------
@pytest.mark.parametrize(
    "extent, row_bytes, sub_chunk_bytes",
    [
        (10, 8, 32),
        (1000, 8, 1),
        (1000, 8, 8),
        (1000, 8, 9),
        (1000, 8, 8000),
        (1000, 8, 10**9),
        (7, 3, 10),
        (2, 1, 1),
        (97, 40, 400),
        (4096, 4, 1000),
        (13, 1, 4),
    ],
)
def test_plan_is_even_non_empty_and_covers_the_extent(extent, row_bytes, sub_chunk_bytes):
    plan = plan_sub_chunks(extent, row_bytes, sub_chunk_bytes, axis=1)
    subs = plan.sub_chunks
    assert plan.axis == 1
    assert plan.extent == extent
    assert [s.index for s in subs] == list(range(len(subs)))
    # contiguous, from 0 to extent, never empty
    assert subs[0].start == 0 and subs[-1].stop == extent
    for a, b in itertools.pairwise(subs):
        assert a.stop == b.start
    assert all(s.extent >= 1 for s in subs)
    # as even as possible
    extents = [s.extent for s in subs]
    assert max(extents) - min(extents) <= 1
    # about sub_chunk_bytes: no sub-chunk exceeds the budget (one row at least), and
    # one fewer sub-chunk could not hold the extent within it
    rows = max(1, sub_chunk_bytes // row_bytes)
    assert max(extents) <= rows
    assert (len(subs) - 1) * rows < extent
    assert len(subs) == min(extent, math.ceil(extent / rows))


@pytest.mark.parametrize("extent", [0, 1, 5, 1000])
def test_plan_without_axis_is_one_sub_chunk(extent):
    plan = plan_sub_chunks(extent, 8, 1, axis=None)
    assert len(plan) == 1
    assert plan.axis is None
    (sub,) = plan.sub_chunks
    assert (sub.index, sub.start, sub.stop) == (0, 0, extent)


@pytest.mark.parametrize("extent, row_bytes", [(0, 8), (1, 8), (100, 0)])
def test_plan_with_nothing_to_split_is_one_sub_chunk(extent, row_bytes):
    plan = plan_sub_chunks(extent, row_bytes, 1, axis=0)
    assert len(plan) == 1
    assert plan.sub_chunks[0].start == 0 and plan.sub_chunks[0].stop == extent


def test_plan_one_row_per_sub_chunk_when_budget_is_tiny():
    plan = plan_sub_chunks(50, 64, 1, axis=0)
    assert [(s.start, s.stop) for s in plan.sub_chunks] == [(i, i + 1) for i in range(50)]


# -- a driver with random completion order ----------------------------------------------
def drive(pipe: Pipeline, rng: random.Random, fail: tuple[int, Stage] | None = None):
    """Complete outstanding actions in random order, checking invariants at every step.

    Sub-chunks complete in any order; the stages of one sub-chunk complete in the order
    they were issued (a stream is in order). When a stage fails, the stages issued behind
    it on its stream never report (the runner skips them).

    Returns the actions issued, in order, and the length of ``pipe.history`` when the
    failure (if any) was delivered.
    """
    issued: list[Action] = []
    failed_at = None
    outstanding: dict[int, list[Action]] = {}  # per sub-chunk, in issue order

    def take(actions: list[Action]) -> None:
        for a in actions:
            if pipe.error is not None:
                raise AssertionError(f"{a} issued after a failure")
            issued.append(a)
            outstanding.setdefault(a.index, []).append(a)

    def check() -> None:
        assert pipe.in_flight <= pipe.window
        assert pipe.max_in_flight <= pipe.window
        assert pipe.window_full == (pipe.in_flight >= pipe.window)
        # Admission is greedy: work is pending only when the window is full, so the
        # submitter is blocked exactly when the window is full and work is pending.
        if pipe.pending:
            assert pipe.window_full
        assert pipe.blocked == (pipe.window_full and pipe.pending > 0)
        # every sub-chunk in flight has work issued, and no other has
        assert len(outstanding) == pipe.in_flight
        for actions in outstanding.values():
            stages = [a.stage for a in actions]
            if pipe.stream_ordered and stages[0] != Stage.STAGE:
                assert stages == ORDER[ORDER.index(stages[0]) :]  # the rest of the stream
            else:
                assert len(stages) == 1  # one stage at a time

    take(pipe.start())
    check()
    while outstanding:
        index = rng.choice(list(outstanding))
        a = outstanding[index].pop(0)
        if fail is not None and (a.index, a.stage) == fail:
            failed_at = len(pipe.history)
            actions = pipe.handle(Failed(a.stage, a.index, RuntimeError("boom")))
            outstanding[index].clear()
        else:
            actions = pipe.handle(Done(a.stage, a.index))
        if not outstanding[index]:
            del outstanding[index]
        take(actions)
        check()
    assert pipe.done
    return issued, failed_at


def stage_orders(pipe: Pipeline) -> dict[int, list[Stage]]:
    per: dict[int, list[Stage]] = {}
    for index, stage in pipe.history:
        per.setdefault(index, []).append(stage)
    return per


@pytest.mark.parametrize("n", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("window", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("staged", [True, False, "mixed"])
@pytest.mark.parametrize("stream_ordered", [False, True])
def test_window_is_never_exceeded_and_is_reached(n, window, staged, stream_ordered):
    for seed in range(5):
        rng = random.Random(seed * 1000 + n * 10 + window)
        flags = [rng.random() < 0.5 for _ in range(n)] if staged == "mixed" else staged
        pipe = Pipeline(n, in_flight=window, staged=flags, stream_ordered=stream_ordered)
        issued, _ = drive(pipe, rng)
        assert pipe.completed == n
        assert pipe.failed == 0 and pipe.error is None
        assert pipe.max_in_flight == min(window, n)
        # every sub-chunk went through its stages once each, in order
        per = stage_orders(pipe)
        assert sorted(per) == list(range(n))
        for i, stages in per.items():
            first = Stage.STAGE if (flags if isinstance(flags, bool) else flags[i]) else Stage.H2D
            assert stages == ORDER[ORDER.index(first) :]
        assert len(issued) == len(pipe.history)
        # sub-chunks are admitted in index order
        firsts = [a.index for a in issued if a.stage in (Stage.STAGE, Stage.H2D)]
        firsts = list(dict.fromkeys(firsts))
        assert firsts == list(range(n))


def test_start_fills_the_window_and_blocks():
    pipe = Pipeline(5, in_flight=2, staged=True)
    assert not pipe.done and not pipe.blocked
    assert pipe.start() == [Action(Stage.STAGE, 0), Action(Stage.STAGE, 1)]
    assert pipe.in_flight == 2 and pipe.pending == 3
    assert pipe.window_full and pipe.blocked
    # intermediate stages only move a sub-chunk along; they never admit another
    assert pipe.handle(Done(Stage.STAGE, 1)) == [Action(Stage.H2D, 1)]
    assert pipe.handle(Done(Stage.H2D, 1)) == [Action(Stage.COMPUTE, 1)]
    assert pipe.handle(Done(Stage.COMPUTE, 1)) == [Action(Stage.D2H, 1)]
    assert pipe.blocked
    # a copy-out completing frees a slot: exactly one sub-chunk is admitted
    assert pipe.handle(Done(Stage.D2H, 1)) == [Action(Stage.STAGE, 2)]
    assert pipe.blocked and pipe.in_flight == 2 and pipe.pending == 2


def test_not_blocked_when_nothing_is_pending():
    pipe = Pipeline(2, in_flight=2, staged=False)
    pipe.start()
    assert pipe.window_full and pipe.pending == 0
    assert not pipe.blocked


def test_large_window_admits_everything_at_once():
    pipe = Pipeline(3, in_flight=10, staged=[True, False, True])
    assert pipe.start() == [
        Action(Stage.STAGE, 0),
        Action(Stage.H2D, 1),
        Action(Stage.STAGE, 2),
    ]
    assert not pipe.window_full and not pipe.blocked and pipe.pending == 0


def test_stream_ordered_issues_a_sub_chunks_device_stages_together():
    pipe = Pipeline(3, in_flight=2, staged=True, stream_ordered=True)
    assert pipe.start() == [Action(Stage.STAGE, 0), Action(Stage.STAGE, 1)]
    assert pipe.handle(Done(Stage.STAGE, 1)) == [
        Action(Stage.H2D, 1),
        Action(Stage.COMPUTE, 1),
        Action(Stage.D2H, 1),
    ]
    # their completions arrive in stream order and issue nothing new
    assert pipe.handle(Done(Stage.H2D, 1)) == []
    with pytest.raises(EngineError, match="waits for COMPUTE"):
        pipe.handle(Done(Stage.D2H, 1))
    assert pipe.handle(Done(Stage.COMPUTE, 1)) == []
    assert pipe.blocked
    assert pipe.handle(Done(Stage.D2H, 1)) == [Action(Stage.STAGE, 2)]
    assert not pipe.blocked and pipe.in_flight == 2


def test_stream_ordered_unstaged_admission_issues_the_whole_stream():
    pipe = Pipeline(2, in_flight=1, staged=False, stream_ordered=True)
    assert pipe.start() == [Action(s, 0) for s in ORDER[1:]]
    assert pipe.blocked
    pipe.handle(Done(Stage.H2D, 0))
    pipe.handle(Done(Stage.COMPUTE, 0))
    assert pipe.handle(Done(Stage.D2H, 0)) == [Action(s, 1) for s in ORDER[1:]]


def test_stream_ordered_drain_waits_for_stages_queued_on_the_stream():
    pipe = Pipeline(5, in_flight=2, staged=False, stream_ordered=True)
    pipe.start()  # 0 and 1: H2D, COMPUTE, D2H each
    pipe.handle(Failed(Stage.H2D, 0, RuntimeError("x")))  # the runner skips 0's others
    assert not pipe.done
    # 1's stages were already queued: each still reports, and nothing new starts
    assert pipe.handle(Done(Stage.H2D, 1)) == []
    assert pipe.handle(Done(Stage.COMPUTE, 1)) == []
    assert not pipe.done
    assert pipe.handle(Done(Stage.D2H, 1)) == []
    assert pipe.done and pipe.completed == 0 and pipe.failed == 1


# -- failures ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ORDER)
@pytest.mark.parametrize("index", [0, 3, 9])
@pytest.mark.parametrize("stream_ordered", [False, True])
def test_failure_drains_without_new_actions(stage, index, stream_ordered):
    for seed in range(5):
        rng = random.Random(seed)
        pipe = Pipeline(10, in_flight=3, staged=True, stream_ordered=stream_ordered)
        issued, failed_at = drive(pipe, rng, fail=(index, stage))
        assert pipe.done
        assert isinstance(pipe.error, RuntimeError) and str(pipe.error) == "boom"
        assert pipe.failed == 1
        assert pipe.pending == 0
        assert pipe.completed < 10
        assert pipe.in_flight == 0
        # the failed sub-chunk never got past the failing stage
        per = stage_orders(pipe)
        assert stage not in per.get(index, [])
        # nothing was admitted after the failure (drive() checks that no action at all was
        # issued), and only copy-outs before it count as completed
        admitted = {a.index for a in issued}
        assert index in admitted
        assert len(admitted) <= pipe.completed + pipe.window
        d2h_before = [i for i, st in pipe.history[:failed_at] if st == Stage.D2H]
        assert pipe.completed == len(d2h_before)


def test_failure_then_in_flight_retire_then_done():
    pipe = Pipeline(6, in_flight=3, staged=False)
    pipe.start()  # H2D 0, 1, 2
    err = ValueError("bad sub-chunk")
    assert pipe.handle(Failed(Stage.H2D, 1, err)) == []
    assert pipe.error is err
    assert pipe.pending == 0 and not pipe.blocked
    assert not pipe.done  # 0 and 2 still in flight
    assert pipe.in_flight == 2
    # what was started may finish its current stage, but nothing further is issued
    assert pipe.handle(Done(Stage.H2D, 0)) == []
    assert not pipe.done
    assert pipe.handle(Failed(Stage.H2D, 2, KeyError("second"))) == []
    assert pipe.done
    assert pipe.error is err  # the first error wins
    assert pipe.failed == 2 and pipe.completed == 0
    with pytest.raises(EngineError):
        pipe.handle(Done(Stage.COMPUTE, 0))  # 0 retired on its H2D: nothing waits


def test_failure_of_the_last_in_flight_is_done_at_once():
    pipe = Pipeline(1, in_flight=1, staged=True)
    pipe.start()
    pipe.handle(Done(Stage.STAGE, 0))
    pipe.handle(Done(Stage.H2D, 0))
    assert pipe.handle(Failed(Stage.COMPUTE, 0, RuntimeError("x"))) == []
    assert pipe.done and pipe.in_flight == 0


# -- protocol violations ----------------------------------------------------------------
def test_start_twice_is_an_error():
    pipe = Pipeline(2, in_flight=1, staged=False)
    pipe.start()
    with pytest.raises(EngineError, match="already started"):
        pipe.start()


def test_event_before_start_is_an_error():
    pipe = Pipeline(2, in_flight=1, staged=False)
    with pytest.raises(EngineError, match="sub-chunk 0 waits for nothing"):
        pipe.handle(Done(Stage.H2D, 0))


@pytest.mark.parametrize(
    "event",
    [
        Done(Stage.COMPUTE, 0),  # skips H2D
        Done(Stage.STAGE, 0),  # not a staged pipeline
        Done(Stage.D2H, 0),
        Done(Stage.H2D, 2),  # not admitted yet
        Done(Stage.H2D, 99),  # no such sub-chunk
        Failed(Stage.COMPUTE, 0, RuntimeError("x")),  # fails a stage it is not in
    ],
)
def test_unexpected_event_is_an_error(event):
    pipe = Pipeline(4, in_flight=2, staged=False)
    pipe.start()
    with pytest.raises(EngineError, match=f"sub-chunk {event.index} waits for"):
        pipe.handle(event)


def test_event_after_completion_is_an_error():
    pipe = Pipeline(1, in_flight=1, staged=False)
    pipe.start()
    for stage in ORDER[1:]:
        pipe.handle(Done(stage, 0))
    assert pipe.done and pipe.completed == 1
    with pytest.raises(EngineError, match="waits for nothing"):
        pipe.handle(Done(Stage.D2H, 0))


def test_repeated_event_is_an_error():
    pipe = Pipeline(2, in_flight=2, staged=True)
    pipe.start()
    pipe.handle(Done(Stage.STAGE, 0))
    with pytest.raises(EngineError, match="waits for H2D"):
        pipe.handle(Done(Stage.STAGE, 0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_sub_chunks=0, in_flight=1, staged=False), "n_sub_chunks must be >= 1, got 0"),
        (dict(n_sub_chunks=3, in_flight=0, staged=False), "in_flight must be >= 1, got 0"),
        (dict(n_sub_chunks=3, in_flight=-2, staged=False), "in_flight must be >= 1, got -2"),
        (dict(n_sub_chunks=3, in_flight=1, staged=[True]), "one entry per sub-chunk"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Pipeline(**kwargs)
