#!/usr/bin/env bash
# GPU run on the device machine: the cuda backend's tests, the __main__ kernel trap and
# the issue-3 benchmark cases. Logs and JSON go to $OUT (default ./bench-out).
#
#   bash ci/gpu.sh [tests|trap|timeline|bench|all] [bench case names...]
#
# Expects the carried wheels in .whl/ (../shared/gpu/fetch-wheels.sh) and installs them
# into /tmp/site unless that was done already.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
if ! python3 -c "import rmm, dask" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
fi
export PYTHONUNBUFFERED=1
status=0

machine() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    python3 -c "import cupy, rmm, dask, numpy; print('cupy', cupy.__version__, 'rmm', rmm.__version__, 'dask', dask.__version__, 'numpy', numpy.__version__)"
    nproc; date -u
}

run_tests() {
    python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-gpu.log" || status=1
}

run_trap() {
    # The trap as users hit it (plain Dask, expected to fail), and with the guard.
    for mode in plain guarded overlap; do
        for kind in elementwise reduction raw; do
            timeout 120 python3 tests/cuda_trap_script.py "$mode" "$kind" >"$OUT/trap-run.log" 2>&1
            rc=$?
            echo "== trap $mode $kind: rc=$rc" \
                "INVALID_HANDLE=$(grep -c INVALID_HANDLE "$OUT/trap-run.log")" \
                "moduleUnload=$(grep -c moduleUnload "$OUT/trap-run.log")" \
                "last: $(grep -v '^ ' "$OUT/trap-run.log" | tail -n 1)"
            [ "$mode" = plain ] && [ "$kind" = elementwise ] && grep -m 3 -B 2 -A 1 \
                "INVALID_HANDLE\|Error" "$OUT/trap-run.log"
        done
    done 2>&1 | tee "$OUT/trap.log"
    rm -f "$OUT/trap-run.log"
}

run_timeline() {
    timeout 200 python3 benchmarks/timeline_cuda.py --json "$OUT/timeline-cuda.json" \
        --png "$OUT/timeline-cuda.png" 2>&1 | tee "$OUT/timeline.log" || status=1
}

bench_case() {  # name, then bench_overlap.py arguments
    local name=$1
    shift
    echo "== bench $name: $*"
    timeout 300 python3 benchmarks/bench_overlap.py --backend cuda --json "$OUT/cases/$name.json" \
        "$@" 2>&1 | tail -n 8 || status=1
}

run_bench() {
    local common=(--size 8GiB --threads 4 --naive-threads ${NAIVE_THREADS:-1,4,8})
    local cases=("$@")
    [ ${#cases[@]} -eq 0 ] && cases=(balanced-pinned balanced-pageable transfer-pinned
        compute-pinned balanced-16MiB)
    mkdir -p "$OUT/cases"
    for c in "${cases[@]}"; do
        case $c in
            balanced-pinned) bench_case "$c" "${common[@]}" --partition 256MiB --workload balanced --pinned-input ;;
            balanced-pageable) (export DASK_OVERLAP__STAGING_THREADS=${STAGING_THREADS:-8}; \
                bench_case "$c" "${common[@]}" --partition 256MiB --workload balanced) ;;
            transfer-pinned) bench_case "$c" "${common[@]}" --partition 256MiB --workload transfer --pinned-input ;;
            transfer-pageable) bench_case "$c" "${common[@]}" --partition 256MiB --workload transfer ;;
            compute-pinned) bench_case "$c" "${common[@]}" --partition 256MiB --workload compute --pinned-input ;;
            balanced-16MiB) bench_case "$c" "${common[@]}" --partition 16MiB --workload balanced --pinned-input ;;
            *) echo "unknown case $c"; status=1 ;;
        esac
    done
    # One file for all cases (the device returns few files).
    python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
cases = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{out}/cases/*.json"))}
json.dump(cases, open(f"{out}/bench-cuda.json", "w"), indent=1)
PY
    rm -rf "$OUT/cases"
}

machine 2>&1 | tee "$OUT/machine.txt"
case $what in
    tests) run_tests ;;
    trap) run_trap ;;
    timeline) run_timeline ;;
    pick)  # time both device resources on 2 GiB, then the benchmark with the faster one
        best=pool; bestv=0
        for mr in pool async; do
            v=$(DASK_OVERLAP_CUDA_DEVICE_MR=$mr timeout 90 python3 benchmarks/diag_cuda.py \
                --parts 8 --variant "$mr" 2>&1 | tee -a "$OUT/pick.log" | grep -o '[0-9.]* GB/s' | head -n 1)
            echo "device resource $mr: $v" | tee -a "$OUT/pick.log"
            v=${v% GB/s}
            if [ -n "$v" ] && python3 -c "import sys; sys.exit(not $v > $bestv)"; then best=$mr; bestv=$v; fi
        done
        echo "using $best" | tee -a "$OUT/pick.log"
        export DASK_OVERLAP_CUDA_DEVICE_MR=$best
        run_timeline; run_bench "$@"; run_tests ;;
    bench) run_bench "$@" ;;
    all) run_tests; run_trap; run_timeline; run_bench "$@" ;;
    *) echo "usage: $0 [tests|trap|timeline|bench|all] [cases...]"; exit 2 ;;
esac
exit $status
