#!/usr/bin/env bash
# Hunt the rare native crash of a gloo rank (issue 23, item 1): run multi-process tests (and
# the demo's smoke run under torchrun) in a loop under light CPU load, with glibc's heap checks
# on and core dumps enabled, and print gdb's native stacks of every core.
#
# Usage (from the repository root):
#   benchmarks/diagnostics/crash_hunt.sh [MINUTES] [pytest targets...]
#   MODE=demo benchmarks/diagnostics/crash_hunt.sh 20        # torchrun examples/train_gpt.py --smoke in a loop
#   MODE=steps benchmarks/diagnostics/crash_hunt.sh 20       # benchmarks/diagnostics/crash_hunt_steps.py: STEPS compiled
#                                                # steps of 5 configs, two copies compared bit for bit
#   MODE=plan_check benchmarks/diagnostics/crash_hunt.sh 30  # benchmarks/plan_validation/plan_check.py: 10 configurations of the
#                                                # bench models in one torchrun job (a rank's SIGSEGV seen there)
#   MODE=teardown CASE=unwaited RUNS=50 STRESS=0 benchmarks/diagnostics/crash_hunt.sh 30
#                                                # benchmarks/diagnostics/valgrind_workloads.py teardown: 2 tiny torchrun
#                                                # ranks that exit after an exception (CASE=exception), with an
#                                                # unwaited all_reduce (unwaited) or a compiled step alive
#                                                # (compiled); DESTROY=1: destroy_process_group first. The
#                                                # exception case fails by design (rc 1); a crash is what counts.
#   SPAWN=0 CHECKS=0 STRESS=0 benchmarks/diagnostics/crash_hunt.sh 20 \
#     "tests/dist/test_optimizer_overlap.py::test_every_optimizer_form_split_bitwise[fully_shard]"
#                                                # as the suite runs (forked ranks, glibc's plain malloc)
#                                                # on torch's two-thread gloo group: how the gloo heap
#                                                # corruption was caught (benchmarks/results/crashes.md)
# RUNS stops the loop after that many runs (default: MINUTES only); STRESS=0 runs without stress-ng;
# CHECKS=0 leaves glibc's heap checks off; SPAWN=0 forks the ranks from the suite's fork server;
# CORES=0 leaves core dumps as the machine has them (`make bench` runs a few minutes of MODE=steps so).
# Defaults: 30 minutes; the tests most likely to race a buffer with gloo's background thread
# (reduce-scatter as all-to-all, in-place all-reduce, buffer reuse, bucketing, overlap).
# Output: $OUT_DIR (default /tmp/crash_hunt): one log per run, summary.txt (runs, failures,
# crashes), cores/ and gdb-*.txt (a core is deleted once gdb has read it; KEEP_CORES=1 keeps
# it). The machine is shared: everything runs under `nice -n 15`, with one stress-ng worker at
# 50% load. Run one hunt at a time: it points the machine's core_pattern at its own directory
# (and restores it at exit). tests/dist/test_launcher.py crashes ranks on purpose: its cores are
# expected (os.abort, a read of address 0), and pass/fail is pytest's.
set -u
MINUTES=${1:-30}
shift || true
MODE=${MODE:-tests}
OUT_DIR=${OUT_DIR:-/tmp/crash_hunt}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(tests/dist/test_gloo_collectives.py tests/dist/test_optimizer_overlap.py
           "tests/dist/test_data_parallel.py::test_bitwise_parity_with_ddp")
fi
mkdir -p "$OUT_DIR/cores"
# Spawned ranks, not the suite's fork server: only a spawned rank runs the interpreter's teardown,
# where a crash at exit happens (tests/dist/launcher.py). SPAWN=0 forks them as the suite does
# (with CHECKS=0 too, the way the gloo heap corruption was found: benchmarks/results/crashes.md).
export SPMD_TEST_SPAWN=${SPAWN:-1}
# The ranks' gloo groups as a user's script makes them (torch's default, two worker threads, on
# which spmd keeps one collective in flight), not the suite's one-thread groups.
export SPMD_TEST_GLOO_THREADS=${SPMD_TEST_GLOO_THREADS:-default}

# stress-ng from Debian's packages (installed here, never by hand).
if [ "${STRESS:-1}" = 1 ] && ! command -v stress-ng >/dev/null; then
  apt-get install -y stress-ng >"$OUT_DIR/apt.log" 2>&1 || { apt-get update >>"$OUT_DIR/apt.log" 2>&1 && apt-get install -y stress-ng >>"$OUT_DIR/apt.log" 2>&1; }
fi

# Core dumps: unlimited size, written to $OUT_DIR/cores when core_pattern is writable (restored at exit).
CORES=${CORES:-1}
OLD_PATTERN=$(cat /proc/sys/kernel/core_pattern)
if [ "$CORES" = 1 ]; then
  ulimit -c unlimited
  [ -w /proc/sys/kernel/core_pattern ] && echo "$OUT_DIR/cores/core.%e.%p.%s" >/proc/sys/kernel/core_pattern
fi
STRESS_PID=
cleanup() {
  [ -n "$STRESS_PID" ] && kill "$STRESS_PID" 2>/dev/null
  [ "$CORES" = 1 ] && [ -w /proc/sys/kernel/core_pattern ] && echo "$OLD_PATTERN" >/proc/sys/kernel/core_pattern
}
trap cleanup EXIT
if [ "${STRESS:-1}" = 1 ] && command -v stress-ng >/dev/null; then
  nice -n 19 stress-ng --cpu 1 --cpu-load 50 --timeout "$((MINUTES * 60 + 120))s" >"$OUT_DIR/stress.log" 2>&1 &
  STRESS_PID=$!
fi

# glibc >= 2.34 reads MALLOC_CHECK_ only with its debug malloc preloaded; the tunables say the same.
DEBUG_MALLOC=$(ls /usr/lib/*/libc_malloc_debug.so.0 2>/dev/null | head -1)
export OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1 PYTHONPATH=$ROOT
if [ "${CHECKS:-1}" = 1 ]; then
  export MALLOC_CHECK_=3
  [ -n "$DEBUG_MALLOC" ] && export LD_PRELOAD=$DEBUG_MALLOC
fi

end=$(($(date +%s) + MINUTES * 60))
runs=0 failed=0 crashes=0
cd "$ROOT"
while [ "$(date +%s)" -lt "$end" ] && { [ -z "${RUNS:-}" ] || [ "$runs" -lt "$RUNS" ]; }; do
  runs=$((runs + 1))
  [ "${CHECKS:-1}" = 1 ] && export MALLOC_PERTURB_=$(((runs * 37) % 255 + 1))  # freed bytes filled, allocations poisoned
  log="$OUT_DIR/run-$runs.log"
  if [ "$MODE" = steps ]; then
    nice -n 15 timeout 1800 "$PY" benchmarks/diagnostics/crash_hunt_steps.py --steps "${STEPS:-200}" >"$log" 2>&1
    rc=$?
  elif [ "$MODE" = plan_check ]; then
    # Where a rank died of SIGSEGV once (2026-11-25, GPT fully_shard, eager backend, under load):
    # the calibration, then 10 configurations compiled and run one after another in one process.
    TMPDIR=$OUT_DIR nice -n 15 timeout 1800 "$PY" benchmarks/plan_validation/plan_check.py --out "$OUT_DIR/plan_check.json" >"$log" 2>&1
    rc=$?
    cat "$OUT_DIR"/spmd_plan_check_*.log >>"$log" 2>/dev/null
    rm -f "$OUT_DIR"/spmd_plan_check_*.log
  elif [ "$MODE" = teardown ]; then
    extra=()
    [ "${DESTROY:-0}" = 1 ] && extra=(--destroy)
    nice -n 15 timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
      benchmarks/diagnostics/valgrind_workloads.py teardown --case "${CASE:-exception}" "${extra[@]}" >"$log" 2>&1
    rc=$?
  elif [ "$MODE" = demo ]; then
    tmp=$(mktemp -d)
    (cd "$tmp" && nice -n 15 timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
      "$ROOT/examples/train_gpt.py" --smoke) >"$log" 2>&1
    rc=$?
    rm -rf "$tmp"
  else
    nice -n 15 timeout 900 "$PY" -m pytest -q -x -p no:cacheprovider "${TARGETS[@]}" >"$log" 2>&1
    rc=$?
  fi
  crash=0
  if grep -qE "Fatal Python error|SIG(ABRT|SEGV|BUS)|exitcode *: *-|malloc\(\)|free\(\)|double free|corrupted|tcache|terminate called|MISMATCH" "$log"; then
    crash=1
  fi
  [ $rc -ne 0 ] && failed=$((failed + 1))
  [ $crash -eq 1 ] && crashes=$((crashes + 1))
  echo "$(date -u +%T) run $runs mode=$MODE case=${CASE:-} destroy=${DESTROY:-0} rc=$rc crash=$crash perturb=${MALLOC_PERTURB_:-none}" | tee -a "$OUT_DIR/summary.txt"
  # Keep only the logs worth reading.
  [ $crash -eq 0 ] && { [ $rc -eq 0 ] || [ "$MODE" = teardown ]; } && rm -f "$log"
done
for core in "$OUT_DIR"/cores/core.*; do
  [ -e "$core" ] || continue
  [ -e "$OUT_DIR/gdb-$(basename "$core").txt" ] && continue
  env -u LD_PRELOAD gdb -batch -ex "info signals SIGABRT" -ex "thread apply all bt 30" "$PY" "$core" \
    >"$OUT_DIR/gdb-$(basename "$core").txt" 2>&1 && [ "${KEEP_CORES:-0}" = 0 ] && rm -f "$core"
done
echo "TOTAL mode=$MODE runs=$runs failed=$failed crashes=$crashes cores=$(ls "$OUT_DIR"/gdb-core.* 2>/dev/null | wc -l) minutes=$MINUTES" | tee -a "$OUT_DIR/summary.txt"
