#!/usr/bin/env bash
# The GPU run on the device machine: GPU tests, the issue-3 benchmark cases, the per-stream
# timeline, the cluster benchmark, the demo and a dashboard snapshot. Logs and JSON go to
# $OUT (default ./bench-out), in few files (the device returns at most 8): each benchmark
# writes its current file ($OUT/default-path.json, overlap.json, cluster.json, ...) and a
# line of $OUT/history.jsonl, the GPU tests their counts too (benchmark gpu-tests). To keep
# a run, copy the current files into benchmarks/results/ and append $OUT/history.jsonl to
# benchmarks/results/history.jsonl (pytest's log stays out of git).
#
#   bash ci/gpu.sh [all|default|small|floor|tests|bench|timeline|cluster|cross|demo|dashboard|trap|peak|pipeline|limits|halo|reuse|pool|streams|gap]...
#   (peak: PEAK_ARGS, PEAK_LIMIT; pipeline: PIPELINE_ARGS, PIPELINE_LIMIT; limits: LIMITS_ARGS,
#   LIMITS_LIMIT; halo: HALO_ARGS, HALO_LIMIT; reuse: REUSE_ARGS, REUSE_LIMIT; pool: POOL_ARGS,
#   POOL_LIMIT; streams: STREAMS_ARGS, STREAMS_LIMIT; gap: GAP_ARGS, GAP_LIMIT)
#
# Benchmark knobs (environment): SIZE, THREADS, SUB_CHUNKS, IN_FLIGHT, REPEAT, NAIVE_THREADS,
# BENCH_CASES, STAGING_THREADS, CASE_LIMIT; cluster: CLUSTER_WORKERS, CLUSTER_THREADS,
# CLUSTER_SIZE, CLUSTER_REPEAT, CLUSTER_LIMIT; cross (needs distributed-ucxx for ucxx): CROSS_ARGS,
# CROSS_LIMIT; small: SMALL_SIZES, SMALL_OUT, SMALL_BATCH, SMALL_TOP, SMALL_PROFILE_SIZE,
# SMALL_LIMIT;
# tests: TESTS_LIMIT, TESTS_MARK, TESTS_PATHS; floor: FLOOR_PARTS, FLOOR_CASES,
# FLOOR_REPEAT, and its py-spy run (GIL_SPY=0 skips it): GIL_CASE, GIL_PART, GIL_NATIVE,
# GIL_RATE (samples a second: at 2000 py-spy fell a minute behind on the H200 host and
# wrote nothing).
#
# Expects the carried wheels in .whl/ (../shared/gpu/fetch-wheels.sh) and installs them
# into /tmp/site unless dask and rmm import already. Each step has its own time limit, so
# one slow step cannot take the others' device time.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
if ! python3 -c "import rmm, dask, distributed" 2>/dev/null; then
    # A warm machine keeps /tmp/site from the call before: installed once, not again.
    if ! PYTHONPATH=/tmp/site python3 -c "import rmm, dask, distributed" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    fi
    export PYTHONPATH=$PWD:/tmp/site
fi
export PYTHONUNBUFFERED=1
SIZE=${SIZE:-8GiB}
NAIVE_THREADS=${NAIVE_THREADS:-8}
status=0
log() { echo "== $(date -u +%T) $*"; }

machine() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    python3 -c "import cupy, rmm, dask, numpy; print('cupy', cupy.__version__, 'rmm', rmm.__version__, 'dask', dask.__version__, 'numpy', numpy.__version__)"
    nproc
}

run_tests() {
    # The whole GPU suite took about 8 minutes on the H200 machine (2026-12-04: 62 % in
    # 300 s): run `tests` alone in one device call (at most 600 s), or split it with
    # TESTS_PATHS over two calls.
    local mark=${TESTS_MARK:-gpu and not slow}
    log "pytest -m \"$mark\""
    timeout "${TESTS_LIMIT:-540}" python3 -m pytest -m "$mark" -q -p no:cacheprovider --timeout 300 \
        --durations 8 ${TESTS_PATHS:-tests} >"$OUT/pytest-gpu.log" 2>&1 || status=1
    tail -n 40 "$OUT/pytest-gpu.log"
    python3 - "$OUT" "$mark" "${TESTS_PATHS:-tests}" <<'PY' || status=1
import sys
sys.path.insert(0, "benchmarks")
import common
out, mark, paths = sys.argv[1:4]
counts = common.gpu_test_counts(open(f"{out}/pytest-gpu.log").read())
result = {"mark": mark, "paths": paths, **counts}
common.record("gpu-tests", counts, common.device_name("cuda"), f"{out}/gpu-tests.json", result)
print("gpu-tests:", counts)
PY
}

run_trap() {
    # plain: Dask alone, which falls in the trap (rc 139 is a crash); overlap must print OK.
    for kind in elementwise ufunc; do
        for mode in plain overlap; do
            timeout 60 python3 tests/cuda_trap_script.py "$mode" "$kind" >/tmp/trap.log 2>&1
            log "trap $mode $kind: rc=$? INVALID_HANDLE=$(grep -c INVALID_HANDLE /tmp/trap.log)" \
                "last: $(grep -v '^ ' /tmp/trap.log | tail -n 1)"
        done
    done
}

bench_case() {  # name, then bench_overlap.py arguments
    local name=$1
    shift
    log "bench $name: $*"
    timeout "${CASE_LIMIT:-75}" python3 benchmarks/bench_overlap.py --backend cuda \
        --record "$OUT" --case "$name" --timeline-json "$OUT/cases/$name.spans" "$@" 2>&1 | grep -v "^ *warn\|Warning" | tail -n 30 || status=1
}

run_bench() {
    # THREADS, SUB_CHUNKS and IN_FLIGHT may be comma lists: every combination is run in
    # the same process, beside the same naive run and ceilings, and the best is reported.
    local common=(--size "$SIZE" --threads "${THREADS:-4}" --naive-threads "$NAIVE_THREADS"
        --sub-chunk "${SUB_CHUNKS:-}" --in-flight "${IN_FLIGHT:-}" --repeat "${REPEAT:-1}")
    local cases=(${BENCH_CASES:-balanced-pinned balanced-pageable transfer-pinned compute-pinned balanced-16MiB})
    mkdir -p "$OUT/cases"
    for c in "${cases[@]}"; do
        case $c in
            balanced-pinned) bench_case "$c" "${common[@]}" --partition 256MiB --workload balanced --pinned-input --out pinned ;;
            balanced-pageable) (export DASK_OVERLAP__STAGING_THREADS=${STAGING_THREADS:-8}; \
                bench_case "$c" "${common[@]}" --partition 256MiB --workload balanced) ;;
            transfer-pinned) bench_case "$c" "${common[@]}" --partition 256MiB --workload transfer --pinned-input --out pinned ;;
            compute-pinned) bench_case "$c" "${common[@]}" --partition 256MiB --workload compute --pinned-input --out pinned ;;
            balanced-16MiB) bench_case "$c" "${common[@]}" --partition 16MiB --workload balanced --pinned-input --out pinned ;;
        esac
    done
    # The cases are in $OUT/overlap.json (one current file); their stage spans in one file.
    python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
spans = {os.path.basename(p)[: -len(".spans")]: json.load(open(p)) for p in sorted(glob.glob(f"{out}/cases/*.spans"))}
json.dump(spans, open(f"{out}/overlap-spans.json", "w"))
PY
    rm -rf "$OUT/cases"
}

run_default() {
    # The path users run: no overlap.* settings, pageable input, result larger than the pool.
    log "default path: bench_default.py ${DEFAULT_ARGS:-}"
    timeout "${DEFAULT_LIMIT:-240}" python3 benchmarks/bench_default.py --record "$OUT" \
        ${DEFAULT_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 30 || status=1
}

run_peak() {
    # A partition's peak host and device memory against plain Dask's (issue 33).
    log "peak memory: peak_memory.py ${PEAK_ARGS:-}"
    timeout "${PEAK_LIMIT:-120}" python3 benchmarks/peak_memory.py --backend cuda --record "$OUT" \
        ${PEAK_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 8 || status=1
}

run_pipeline() {
    # A pipeline, not one call (issue 29): chained stages, elementwise, reduction, store.
    log "pipeline: bench_pipeline.py ${PIPELINE_ARGS:-}"
    timeout "${PIPELINE_LIMIT:-300}" python3 benchmarks/bench_pipeline.py --backend cuda \
        --record "$OUT" ${PIPELINE_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 25 || status=1
}

run_limits() {
    # Issue 31's table in one call: every row beside its bound or reference (limits.json).
    log "limits: bench_limits.py ${LIMITS_ARGS:-}"
    timeout "${LIMITS_LIMIT:-540}" python3 benchmarks/bench_limits.py --backend cuda \
        --record "$OUT" ${LIMITS_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 40 || status=1
}

run_reuse() {
    # Issue 31's "beyond the anchors": results written into memory of results Dask let go
    # (overlap.result-pool-size), persisted and stored, against fresh memory (result-reuse.json).
    log "reuse: result_reuse.py ${REUSE_ARGS:-}"
    timeout "${REUSE_LIMIT:-240}" python3 benchmarks/diagnostics/result_reuse.py \
        --record "$OUT" ${REUSE_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 14 || status=1
}

run_pool() {
    # Issue 31's 3-D filter: the device pool's reuse across streams, three resources in
    # processes of their own, in turn (pool-reuse.json).
    log "pool: pool_reuse.py ${POOL_ARGS:-}"
    timeout "${POOL_LIMIT:-240}" python3 benchmarks/diagnostics/pool_reuse.py \
        --record "$OUT" ${POOL_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 40 || status=1
}

run_gap() {
    # Issue 31's demo row: the demo's cluster against the same partitions on the threaded
    # scheduler, with one thing changed at a time (demo_gap.py --variants; its log only).
    log "gap: demo_gap.py ${GAP_ARGS:-}"
    timeout "${GAP_LIMIT:-180}" python3 benchmarks/diagnostics/demo_gap.py \
        ${GAP_ARGS:---variants as-is,no-trim,as-is,no-trim --repeat 4} >"$OUT/demo-gap.log" 2>&1 \
        || status=1
    grep -v "Warning\|warn" "$OUT/demo-gap.log" | tail -n 40
}

run_streams() {
    # Issue 31's pinned path: the same copies and kernel in plain CuPy (each sub-chunk on a
    # stream of its own as the library, the copies on one stream each way, or a bounded
    # window), beside the library's path by in_flight, switch interval and, with
    # --timing sampled|all|off, its device timing as shipped, on every sub-chunk or off
    # (copy-streams.json).
    log "streams: copy_streams.py ${STREAMS_ARGS:-}"
    timeout "${STREAMS_LIMIT:-180}" python3 benchmarks/diagnostics/copy_streams.py \
        --record "$OUT" ${STREAMS_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 20 || status=1
}

run_halo() {
    # A filter with halos (issue 30): map_overlap against the naive path, the padded blocks
    # built on the host, and the same filter with no halo.
    log "halo: bench_halo.py ${HALO_ARGS:-}"
    timeout "${HALO_LIMIT:-300}" python3 benchmarks/bench_halo.py --backend cuda \
        --record "$OUT" ${HALO_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -n 15 || status=1
}

run_timeline() {
    log "timeline"
    timeout 60 python3 benchmarks/diagnostics/timeline_cuda.py --json "$OUT/timeline-cuda.json" \
        --png "$OUT/timeline-cuda.png" 2>&1 | tail -n 4 || status=1
}

run_cluster() {
    # CLUSTER_WORKERS: a space-separated list of worker counts ("default" = one per GPU;
    # more workers than GPUs share them, e.g. 2 on one H200).
    local w flag
    for w in ${CLUSTER_WORKERS:-default}; do
        [ "$w" = default ] && w=""
        flag=${w:+--workers $w}
        log "cluster bench: LocalGPUCluster ${w:-one per GPU} worker(s), threads ${CLUSTER_THREADS:-1,4}"
        timeout "${CLUSTER_LIMIT:-100}" python3 benchmarks/bench_cluster.py $flag \
            --threads "${CLUSTER_THREADS:-1,4}" --size "${CLUSTER_SIZE:-2GiB}" --partition 256MiB \
            --repeat "${CLUSTER_REPEAT:-1}" --record "$OUT" \
            2>&1 | grep -v "^ \|Warning\|warn" | tail -n 8 || status=1
    done
}

run_cross() {
    # Issue 16: partitions crossing two workers, by protocol (tcp, ucxx) and chunks (host, device).
    log "cross-worker bench: bench_cross.py ${CROSS_ARGS:-}"
    timeout "${CROSS_LIMIT:-300}" python3 benchmarks/bench_cross.py --record "$OUT" \
        ${CROSS_ARGS:-} 2>&1 | grep -v "^ \|Warning\|warn" | tail -n 30 || status=1
}

run_small() {
    # Issue 12: small partitions against the bound, host us per partition, the ring forced
    # on for the sizes under direct-bytes, and (SMALL_TOP > 0) a profile of 16 MiB partitions.
    local out
    for out in ${SMALL_OUT:-host pinned}; do
        log "small partitions, out=$out: ${SMALL_SIZES:-256MiB,16MiB,4MiB,1MiB,256KiB}"
        timeout "${SMALL_LIMIT:-240}" python3 benchmarks/diagnostics/small_partitions.py --direct-off --out "$out" \
            --sizes "${SMALL_SIZES:-256MiB,16MiB,4MiB,1MiB,256KiB}" --profile "${SMALL_TOP:-0}" \
            --profile-size "${SMALL_PROFILE_SIZE:-16MiB}" \
            --batch "${SMALL_BATCH:-}" \
            --record "$OUT" 2>&1 | grep -v "Warning\|warn" \
            | grep -v "^  sub-chunk\|^  naive\|^  dask_overlap\|^  bound\|^backend=\|^  overlap/bound" \
            | tail -n "${SMALL_TAIL:-30}" || status=1
    done
}

run_floor() {
    # Issue 12: what one Dask task per partition can reach (bare CuPy, plain Dask with a no-op
    # func, the same work by hand in a task) beside dask_overlap, per partition size; then,
    # where py-spy is installed, which functions hold the GIL while dask_overlap runs.
    local part
    for part in ${FLOOR_PARTS:-16777216 4194304}; do
        log "floors, partition $part bytes: ${FLOOR_CASES:-all}"
        PART=$part timeout "${FLOOR_LIMIT:-150}" python3 benchmarks/diagnostics/threads_floor.py \
            --cases "${FLOOR_CASES:-}" 2>&1 | grep -v "Warning\|warn" || status=1
    done
    if [ "${GIL_SPY:-1}" != 0 ] && { command -v py-spy >/dev/null || [ -x /tmp/site/bin/py-spy ]; }; then
        local spy
        spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
        log "py-spy --gil on ${GIL_CASE:-ours4}, partition ${GIL_PART:-4194304}"
        PART=${GIL_PART:-4194304} FLOOR_REPEAT=${GIL_REPEAT:-10} timeout 120 "$spy" record --gil \
            --rate "${GIL_RATE:-250}" --format raw ${GIL_NATIVE:+--native} --output "$OUT/gil-${GIL_CASE:-ours4}.txt" \
            -- python3 benchmarks/diagnostics/threads_floor.py --cases "${GIL_CASE:-ours4}" 2>&1 \
            | grep -v "Warning\|warn" | tail -n 5 || status=1
        python3 benchmarks/diagnostics/spy_summary.py "$OUT/gil-${GIL_CASE:-ours4}.txt" --top "${GIL_TOP:-45}" || status=1
    fi
}

run_demo() {
    log "demo"
    timeout 60 python3 -m dask_overlap demo 2>&1 | grep -v "^ \|Warning\|warn" | tail -n 8 || status=1
}

run_dashboard() {
    log "dashboard snapshot capture"
    timeout 75 python3 benchmarks/diagnostics/dashboard_snapshot.py capture "$OUT/dashboard-snapshot.json" --gib 1 --delay 0.2 \
        2>&1 | tail -n 3 || status=1
}

machine 2>&1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
for step in "${steps[@]}"; do
    case $step in
        all) run_default; run_small; run_bench; run_tests; run_timeline; run_demo; run_cluster; run_dashboard ;;
        default) run_default ;;
        tests) run_tests ;;
        bench) run_bench ;;
        timeline) run_timeline ;;
        cluster) run_cluster ;;
        cross) run_cross ;;
        demo) run_demo ;;
        dashboard) run_dashboard ;;
        trap) run_trap ;;
        peak) run_peak ;;
        pipeline) run_pipeline ;;
        limits) run_limits ;;
        halo) run_halo ;;
        reuse) run_reuse ;;
        pool) run_pool ;;
        streams) run_streams ;;
        gap) run_gap ;;
        small) run_small ;;
        floor) run_floor ;;
        *) echo "usage: $0 [all|default|tests|bench|timeline|cluster|cross|demo|dashboard|trap|small|floor|peak|pipeline|limits|halo|reuse|pool|streams|gap]..."; exit 2 ;;
    esac
done
log "done, status $status"
exit $status
