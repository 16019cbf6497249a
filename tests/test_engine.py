"""The engine driven directly: no threads, no backend, no Dask."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dask_overlap.pipeline.engine import (
    Action,
    Done,
    EngineError,
    Failed,
    Pipeline,
    Stage,
    plan_sub_chunks,
)


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
DEVICE = [Stage.H2D, Stage.COMPUTE, Stage.D2H]


def drive(pipe: Pipeline, rng: random.Random, fail: tuple[int, Stage] | None = None):
    """Complete outstanding work in random order, checking invariants at every step.

    Sub-chunks complete in any order. A sub-chunk's device stages (H2D, COMPUTE, D2H) are
    issued together, by one action, and report once, as D2H, unless one of them fails. When a stage
    fails, nothing issued behind it for that sub-chunk reports.

    Returns the actions issued, in order, the completions delivered, in order, and how
    many completions had been delivered when the failure (if any) was.
    """
    issued: list[Action] = []
    delivered: list[tuple[int, Stage]] = []
    failed_at = None
    outstanding: dict[int, Stage] = {}  # sub-chunk -> the stage it will report next

    def take(actions: list[Action]) -> None:
        for a in actions:
            if pipe.error is not None:
                raise AssertionError(f"{a} issued after a failure")
            issued.append(a)
        by_index: dict[int, list[Stage]] = {}
        for a in actions:
            by_index.setdefault(a.index, []).append(a.stage)
        for i, stages in by_index.items():
            assert i not in outstanding, f"{i} issued twice"
            if stages[0] == Stage.H2D:
                assert stages == [Stage.H2D]  # one action: the device work, H2D to D2H
                outstanding[i] = Stage.D2H
            else:
                assert len(stages) == 1
                outstanding[i] = stages[0]

    def check() -> None:
        assert pipe.in_flight <= pipe.window
        assert pipe.max_in_flight <= pipe.window
        assert pipe.window_full == (pipe.in_flight >= pipe.window)
        # Admission is greedy: work is pending only when the window is full, so the
        # submitter is blocked exactly when the window is full and work is pending.
        if pipe.pending:
            assert pipe.window_full
        assert pipe.blocked == (pipe.window_full and pipe.pending > 0)
        assert len(outstanding) == pipe.in_flight

    take(pipe.start())
    check()
    while outstanding:
        index = rng.choice(list(outstanding))
        stage = outstanding.pop(index)
        if (
            fail is not None
            and fail[0] == index
            and (fail[1] == stage or (stage == Stage.D2H and fail[1] in DEVICE))
        ):
            failed_at = len(delivered)
            actions = pipe.handle(Failed(fail[1], index, RuntimeError("boom")))
        else:
            delivered.append((index, stage))
            actions = pipe.handle(Done(stage, index))
        take(actions)
        check()
    assert pipe.done
    return issued, delivered, failed_at


def stage_orders(delivered: list[tuple[int, Stage]]) -> dict[int, list[Stage]]:
    per: dict[int, list[Stage]] = {}
    for index, stage in delivered:
        per.setdefault(index, []).append(stage)
    return per


def expected_stages(staged: bool, unstaged: bool) -> list[Stage]:
    return [Stage.STAGING] * staged + [Stage.D2H] + [Stage.UNSTAGING] * unstaged


@pytest.mark.parametrize("n", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("window", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("staged", [True, False, "mixed"])
@pytest.mark.parametrize("unstaged", [True, False, "mixed"])
def test_window_is_never_exceeded_and_is_reached(n, window, staged, unstaged):
    for seed in range(3):
        rng = random.Random(seed * 1000 + n * 10 + window)
        s_flags = [rng.random() < 0.5 for _ in range(n)] if staged == "mixed" else [staged] * n
        u_flags = [rng.random() < 0.5 for _ in range(n)] if unstaged == "mixed" else [unstaged] * n
        pipe = Pipeline(n, in_flight=window, staged=s_flags, unstaged=u_flags)
        issued, delivered, _ = drive(pipe, rng)
        assert pipe.completed == n
        assert pipe.failed == 0 and pipe.error is None
        assert pipe.max_in_flight == min(window, n)
        # every sub-chunk went through its stages once each, in order
        per = stage_orders(delivered)
        assert sorted(per) == list(range(n))
        for i, stages in per.items():
            assert stages == expected_stages(s_flags[i], u_flags[i])
        # sub-chunks are admitted in index order
        firsts = dict.fromkeys(a.index for a in issued if a.stage in (Stage.STAGING, Stage.H2D))
        assert list(firsts) == list(range(n))


def test_start_fills_the_window_and_blocks():
    pipe = Pipeline(5, in_flight=2, staged=True, unstaged=True)
    assert not pipe.done and not pipe.blocked
    assert pipe.start() == [Action(Stage.STAGING, 0), Action(Stage.STAGING, 1)]
    assert pipe.in_flight == 2 and pipe.pending == 3
    assert pipe.window_full and pipe.blocked
    # intermediate stages only move a sub-chunk along; they never admit another
    assert pipe.handle(Done(Stage.STAGING, 1)) == [Action(Stage.H2D, 1)]
    assert pipe.handle(Done(Stage.D2H, 1)) == [Action(Stage.UNSTAGING, 1)]
    assert pipe.blocked
    # the last stage completing frees a slot: exactly one sub-chunk is admitted
    assert pipe.handle(Done(Stage.UNSTAGING, 1)) == [Action(Stage.STAGING, 2)]
    assert pipe.blocked and pipe.in_flight == 2 and pipe.pending == 2


def test_not_blocked_when_nothing_is_pending():
    pipe = Pipeline(2, in_flight=2, staged=False)
    pipe.start()
    assert pipe.window_full and pipe.pending == 0
    assert not pipe.blocked


def test_large_window_admits_everything_at_once():
    pipe = Pipeline(3, in_flight=10, staged=[True, False, True])
    assert pipe.start() == [
        Action(Stage.STAGING, 0),
        *[Action(Stage.H2D, 1)],
        Action(Stage.STAGING, 2),
    ]
    assert not pipe.window_full and not pipe.blocked and pipe.pending == 0


def test_device_stages_report_once_and_only_d2h_completes_them():
    pipe = Pipeline(2, in_flight=1, staged=False)
    assert pipe.start() == [Action(Stage.H2D, 0)]
    for stage in (Stage.H2D, Stage.COMPUTE):  # enqueued with the D2H: no event of their own
        with pytest.raises(EngineError, match="waits for D2H"):
            pipe.handle(Done(stage, 0))
    assert pipe.handle(Done(Stage.D2H, 0)) == [Action(Stage.H2D, 1)]


@pytest.mark.parametrize("stage", DEVICE)
def test_any_device_stage_may_fail_while_d2h_is_awaited(stage):
    pipe = Pipeline(3, in_flight=2, staged=False)
    pipe.start()
    assert pipe.handle(Failed(stage, 0, RuntimeError("x"))) == []
    assert pipe.failed == 1 and pipe.pending == 0 and not pipe.done
    assert pipe.handle(Done(Stage.D2H, 1)) == []  # drained: nothing new
    assert pipe.done and pipe.completed == 0


def test_drain_does_not_unstage_what_completed_after_a_failure():
    pipe = Pipeline(4, in_flight=2, staged=False, unstaged=True)
    pipe.start()
    pipe.handle(Failed(Stage.COMPUTE, 1, RuntimeError("x")))
    assert pipe.handle(Done(Stage.D2H, 0)) == []  # no UNSTAGE: its result is not wanted
    assert pipe.done and pipe.completed == 0


# -- admission gated by the ring ----------------------------------------------------------
def test_refused_admission_stalls_until_retried():
    room = {"free": 1}

    def admit(i: int) -> bool:
        if room["free"]:
            room["free"] -= 1
            return True
        return False

    pipe = Pipeline(3, in_flight=3, staged=False, admit=admit)
    assert pipe.start() == [Action(Stage.H2D, 0)]
    assert pipe.stalled and pipe.blocked and not pipe.window_full
    assert pipe.retry() == []  # still no room
    room["free"] = 1
    assert pipe.retry() == [Action(Stage.H2D, 1)]
    # a completion retries by itself
    room["free"] = 1
    assert pipe.handle(Done(Stage.D2H, 0)) == [Action(Stage.H2D, 2)]
    assert not pipe.stalled and not pipe.blocked
    pipe.handle(Done(Stage.D2H, 1))
    pipe.handle(Done(Stage.D2H, 2))
    assert pipe.done and pipe.completed == 3


def test_admission_is_asked_in_index_order_once_per_admitted_sub_chunk():
    asked: list[int] = []
    rng = random.Random(7)

    def admit(i: int) -> bool:
        asked.append(i)
        return rng.random() < 0.4

    pipe = Pipeline(20, in_flight=4, staged=True, unstaged=True, admit=admit)
    actions = pipe.start()
    admitted: list[int] = []
    outstanding: dict[int, Stage] = {}
    while not pipe.done:
        for a in actions:
            if a.stage in (Stage.STAGING, Stage.H2D) and a.index not in admitted:
                admitted.append(a.index)
            # the device work reports once, as its D2H
            outstanding[a.index] = Stage.D2H if a.stage == Stage.H2D else a.stage
        if not outstanding:
            assert pipe.stalled
            actions = pipe.retry()
            continue
        i = rng.choice(list(outstanding))
        actions = pipe.handle(Done(outstanding.pop(i), i))
    assert admitted == list(range(20))
    # each index is asked until it is admitted, and none is asked before its turn
    assert [i for i, _ in itertools.groupby(asked)] == list(range(20))


# -- failures ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage", list(Stage))
@pytest.mark.parametrize("index", [0, 3, 9])
def test_failure_drains_without_new_actions(stage, index):
    for seed in range(5):
        rng = random.Random(seed)
        pipe = Pipeline(10, in_flight=3, staged=True, unstaged=True)
        issued, delivered, failed_at = drive(pipe, rng, fail=(index, stage))
        assert pipe.done
        assert isinstance(pipe.error, RuntimeError) and str(pipe.error) == "boom"
        assert pipe.failed == 1
        assert pipe.pending == 0
        assert pipe.completed < 10
        assert pipe.in_flight == 0
        # the failed sub-chunk never reported the failing stage (or any after it)
        per = stage_orders(delivered)
        reported = per.get(index, [])
        assert stage not in reported and Stage.UNSTAGING not in reported
        # nothing was admitted after the failure (drive() checks that no action at all was
        # issued), and only what finished before it counts as completed
        admitted = {a.index for a in issued}
        assert index in admitted
        assert len(admitted) <= pipe.completed + pipe.window
        finished = [i for i, st in delivered[:failed_at] if st == Stage.UNSTAGING]
        assert pipe.completed == len(finished)


def test_failure_then_in_flight_retire_then_done():
    pipe = Pipeline(6, in_flight=3, staged=True)
    pipe.start()  # STAGE 0, 1, 2
    err = ValueError("bad sub-chunk")
    assert pipe.handle(Failed(Stage.STAGING, 1, err)) == []
    assert pipe.error is err
    assert pipe.pending == 0 and not pipe.blocked
    assert not pipe.done  # 0 and 2 still in flight
    assert pipe.in_flight == 2
    # what was started may finish its current stage, but nothing further is issued
    assert pipe.handle(Done(Stage.STAGING, 0)) == []
    assert not pipe.done
    assert pipe.handle(Failed(Stage.STAGING, 2, KeyError("second"))) == []
    assert pipe.done
    assert pipe.error is err  # the first error wins
    assert pipe.failed == 2 and pipe.completed == 0
    with pytest.raises(EngineError):
        pipe.handle(Done(Stage.D2H, 0))  # 0 retired on its STAGE: nothing waits


def test_failure_of_the_last_in_flight_is_done_at_once():
    pipe = Pipeline(1, in_flight=1, staged=True)
    pipe.start()
    pipe.handle(Done(Stage.STAGING, 0))
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
        pipe.handle(Done(Stage.D2H, 0))


@pytest.mark.parametrize(
    "event",
    [
        Done(Stage.COMPUTE, 0),  # reported with the D2H, never alone
        Done(Stage.STAGING, 0),  # not a staged pipeline
        Done(Stage.UNSTAGING, 0),  # not copied out yet (and not unstaged)
        Done(Stage.D2H, 2),  # not admitted yet
        Done(Stage.D2H, 99),  # no such sub-chunk
        Failed(Stage.STAGING, 0, RuntimeError("x")),  # fails a stage it is not in
        Failed(Stage.UNSTAGING, 0, RuntimeError("x")),
    ],
)
def test_unexpected_event_is_an_error(event):
    pipe = Pipeline(4, in_flight=2, staged=False)
    pipe.start()
    with pytest.raises(EngineError, match=f"sub-chunk {event.index} waits for"):
        pipe.handle(event)


def test_event_after_completion_is_an_error():
    pipe = Pipeline(1, in_flight=1, staged=False, unstaged=True)
    pipe.start()
    pipe.handle(Done(Stage.D2H, 0))
    pipe.handle(Done(Stage.UNSTAGING, 0))
    assert pipe.done and pipe.completed == 1
    with pytest.raises(EngineError, match="waits for nothing"):
        pipe.handle(Done(Stage.UNSTAGING, 0))


def test_repeated_event_is_an_error():
    pipe = Pipeline(2, in_flight=2, staged=True)
    pipe.start()
    pipe.handle(Done(Stage.STAGING, 0))
    with pytest.raises(EngineError, match="waits for D2H"):
        pipe.handle(Done(Stage.STAGING, 0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_sub_chunks=0, in_flight=1, staged=False), "n_sub_chunks must be >= 1, got 0"),
        (dict(n_sub_chunks=3, in_flight=0, staged=False), "in_flight must be >= 1, got 0"),
        (dict(n_sub_chunks=3, in_flight=-2, staged=False), "in_flight must be >= 1, got -2"),
        (dict(n_sub_chunks=3, in_flight=1, staged=[True]), "staged must have one entry"),
        (
            dict(n_sub_chunks=2, in_flight=1, staged=False, unstaged=[True] * 3),
            "unstaged must have one entry per sub-chunk",
        ),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Pipeline(**kwargs)
