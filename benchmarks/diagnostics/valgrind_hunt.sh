#!/usr/bin/env bash
# Run 2-rank gloo workloads with every rank under valgrind memcheck (issue 23, item 1): a memory
# checker sees a write to freed or out-of-bounds heap memory when it happens, even when the
# process does not crash ("malloc(): unaligned tcache chunk detected" is what such a write looks
# like when glibc notices it later).
#
# Usage (from the repository root):
#   benchmarks/diagnostics/valgrind_hunt.sh steps   # benchmarks/diagnostics/crash_hunt_steps.py under torchrun: STEPS steps of
#                                       # CONFIGS (indices into its CONFIGS; fully_shard all-to-all
#                                       # reduce-scatters, replicate in-place all-reduce, reuse_dead_buffers)
#   benchmarks/diagnostics/valgrind_hunt.sh demo    # torchrun examples/train_gpt.py --smoke $DEMO_ARGS (covers the
#                                       # process exit)
#   benchmarks/diagnostics/valgrind_hunt.sh control # benchmarks/diagnostics/valgrind_control.py: an in-flight all_reduce's buffer
#                                       # freed on purpose; rank 0's log must show gloo's invalid access
#   benchmarks/diagnostics/valgrind_hunt.sh eager_clip  # one process, no process group: the clip's ops eagerly
#                                       # (Python API, torch.ops.aten boxed), clip_grad_norm_, then
#                                       # spmd's clipped step at world size 1; the log split by phase
#   benchmarks/diagnostics/valgrind_hunt.sh refs    # DDP, FSDP2 fully_shard, then spmd fully_shard, STEPS steps each,
#                                       # in the same rank processes (as the parity tests run them)
#   benchmarks/diagnostics/valgrind_hunt.sh expand  # tests/dist/test_expand.py's 1-D tensor-parallel case, STEPS steps
#   benchmarks/diagnostics/valgrind_hunt.sh teardown  # a rank's exit: CASE=exception|unwaited|compiled, DESTROY=1
#                                       # (benchmarks/diagnostics/valgrind_workloads.py teardown)
#   BACKEND=inductor benchmarks/diagnostics/valgrind_hunt.sh steps  # the inductor backend: compiled natively
#                                       # first (same TORCHINDUCTOR_CACHE_DIR), then run from that cache
#   benchmarks/diagnostics/valgrind_hunt.sh noise   # one process: import torch + spmd, a matmul; writes the
#                                       # suppressions of that start-up noise to $OUT_DIR/noise.supp
#                                       # (benchmarks/diagnostics/valgrind.supp is made from it, see valgrind_report.py)
# Environment: OUT_DIR (default /tmp/valgrind_hunt), STEPS (3), CONFIGS (0,2), COPIES (1), DEMO_ARGS,
# VG_EXTRA (more valgrind options: --track-origins=yes says where an uninitialised value was made),
# TIMEOUT seconds per run (2400), CPU (the one CPU both ranks share, 1; the machine is shared).
# Output: $OUT_DIR/<mode>-<time>/: run.log (torchrun and the workers' output), rank<R>.<pid>.log
# (valgrind's log per process), summary.txt (benchmarks/diagnostics/valgrind_report.py's reading of the logs).
#
# Each rank: PYTHONMALLOC=malloc (so memcheck sees every Python object's allocation instead of
# pymalloc's arenas), --error-limit=no --num-callers=40 --track-origins=no (speed) --leak-check=no
# (a leak is not the bug hunted, and the check at exit takes minutes), --smc-check=all-non-file
# (oneDNN generates code at run time), --fair-sched=yes (gloo's threads), the suppressions in
# benchmarks/diagnostics/valgrind.supp (CPython's and the loader's start-up noise). Under valgrind torch runs
# ~40x slower (import torch: 1m45s instead of 2.5s): a run of the defaults takes tens of minutes.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT_DIR=${OUT_DIR:-/tmp/valgrind_hunt}
SUPP=${SUPP:-$ROOT/benchmarks/diagnostics/valgrind.supp}
# shellcheck disable=SC2206 # VG_EXTRA: more valgrind options, as words (e.g. --track-origins=yes)
VG_OPTS=(--tool=memcheck --error-limit=no --num-callers=40 --track-origins=no --leak-check=no
         --smc-check=all-non-file --fair-sched=yes ${VG_EXTRA:-})

if [ "${1:-}" = --rank ]; then
  # What torchrun runs for each rank (torchrun --no-python): this rank's interpreter under valgrind.
  shift
  exec valgrind "${VG_OPTS[@]}" --suppressions="$SUPP" --log-file="$VG_DIR/rank%q{RANK}.%p.log" "$PY" "$@"
fi

MODE=${1:?usage: benchmarks/diagnostics/valgrind_hunt.sh steps|demo|control|noise|eager_clip|refs|teardown|expand}
STEPS=${STEPS:-3}
CONFIGS=${CONFIGS:-0,2}
BACKEND=${BACKEND:-eager}
CASE=${CASE:-exception}
COPIES=${COPIES:-1}
TIMEOUT=${TIMEOUT:-2400}
CPU=${CPU:-1}

# valgrind from Debian's packages (installed here, never by hand; this runs as root, without sudo).
if ! command -v valgrind >/dev/null; then
  mkdir -p "$OUT_DIR"
  apt-get install -y valgrind >"$OUT_DIR/apt.log" 2>&1 ||
    { apt-get update >>"$OUT_DIR/apt.log" 2>&1 && apt-get install -y valgrind >>"$OUT_DIR/apt.log" 2>&1; } ||
    { echo "could not install valgrind, see $OUT_DIR/apt.log" >&2; exit 1; }
fi

export VG_DIR="$OUT_DIR/$MODE-$(date -u +%Y%m%dT%H%M%S)"
mkdir -p "$VG_DIR"
export PYTHONMALLOC=malloc OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1 PYTHONPATH=$ROOT
cd "$ROOT"
start=$(date +%s)
# torchrun itself runs natively; only the ranks run under valgrind (--no-python: the entry point
# is this script, which execs valgrind on the interpreter). All on one CPU, at the lowest priority.
RUN=(nice -n 19 taskset -c "$CPU" timeout "$TIMEOUT")
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=2 --no-python "$ROOT/benchmarks/diagnostics/valgrind_hunt.sh" --rank)
case "$MODE" in
  steps)
    if [ "$BACKEND" = inductor ]; then
      # Inductor's compile under memcheck would take hours: compile natively first into the same
      # on-disk cache, so the checked run loads the compiled kernels from it (and runs them).
      export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$OUT_DIR/inductor_cache} TORCHINDUCTOR_COMPILE_THREADS=1
      nice -n 19 taskset -c "$CPU" "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
        benchmarks/diagnostics/crash_hunt_steps.py --steps 1 --configs "$CONFIGS" --copies 1 --backend inductor \
        >"$VG_DIR/warm.log" 2>&1 || { echo "the native warm-up failed, see $VG_DIR/warm.log" >&2; exit 1; }
    fi
    "${RUN[@]}" "${TORCHRUN[@]}" benchmarks/diagnostics/crash_hunt_steps.py --steps "$STEPS" --configs "$CONFIGS" \
      --copies "$COPIES" --backend "$BACKEND" >"$VG_DIR/run.log" 2>&1
    ;;
  refs | expand)
    "${RUN[@]}" "${TORCHRUN[@]}" benchmarks/diagnostics/valgrind_workloads.py "$MODE" --steps "$STEPS" >"$VG_DIR/run.log" 2>&1
    ;;
  teardown)
    extra=()
    [ "${DESTROY:-0}" = 1 ] && extra=(--destroy)
    "${RUN[@]}" "${TORCHRUN[@]}" benchmarks/diagnostics/valgrind_workloads.py teardown --case "$CASE" "${extra[@]}" \
      >"$VG_DIR/run.log" 2>&1
    ;;
  demo)
    tmp=$(mktemp -d)  # the demo writes its checkpoint and graph dumps to the working directory
    # shellcheck disable=SC2086 # DEMO_ARGS: words
    (cd "$tmp" && "${RUN[@]}" "${TORCHRUN[@]}" "$ROOT/examples/train_gpt.py" --smoke ${DEMO_ARGS:-}) >"$VG_DIR/run.log" 2>&1
    rc=$?
    rm -rf "$tmp"
    (exit $rc)
    ;;
  control)
    "${RUN[@]}" "${TORCHRUN[@]}" benchmarks/diagnostics/valgrind_control.py >"$VG_DIR/run.log" 2>&1
    ;;
  noise)
    "${RUN[@]}" valgrind "${VG_OPTS[@]}" --gen-suppressions=all --log-file="$VG_DIR/rank0.%p.log" \
      "$PY" -c "import torch, torch.distributed, spmd; x = torch.randn(64, 64); (x @ x).sum().item()" \
      >"$VG_DIR/run.log" 2>&1
    ;;
  eager_clip)
    # One process, valgrind's log on stderr with the workload's "=== phase" markers, so the log
    # splits by phase below (phase-<name>.log); VG_EXTRA=--track-origins=yes says where each
    # uninitialised value was made.
    "${RUN[@]}" valgrind "${VG_OPTS[@]}" --suppressions="$SUPP" --log-fd=2 \
      "$PY" benchmarks/diagnostics/valgrind_workloads.py eager_clip >"$VG_DIR/run.log" 2>&1
    rc=$?
    awk -v d="$VG_DIR" 'BEGIN { f = d "/rank0.phase-start.log" }
      /^=== phase / { f = d "/rank0.phase-" $3 ".log"; next } { print > f }' "$VG_DIR/run.log"
    for f in "$VG_DIR"/rank0.phase-*.log; do
      echo "--- $(basename "$f"): $(grep -cE '^==[0-9]+== (Conditional jump|Use of uninit|Invalid|Syscall param)' "$f") error contexts"
    done
    (exit $rc)
    ;;
  *)
    echo "unknown mode $MODE (steps, demo, control, noise or eager_clip)" >&2
    exit 2
    ;;
esac
rc=$?
wall=$(($(date +%s) - start))
{
  echo "mode=$MODE rc=$rc wall_s=$wall steps=$STEPS configs=$CONFIGS copies=$COPIES backend=$BACKEND" \
    "case=$CASE destroy=${DESTROY:-0} demo_args=${DEMO_ARGS:-}" \
    "$(valgrind --version)"
  "$PY" "$ROOT/benchmarks/diagnostics/valgrind_report.py" "$VG_DIR"/rank*.log
} | tee "$VG_DIR/summary.txt"
if [ "$MODE" = noise ]; then
  "$PY" "$ROOT/benchmarks/diagnostics/valgrind_report.py" --supp "$VG_DIR"/rank*.log >"$VG_DIR/noise.supp"
  echo "suppressions: $VG_DIR/noise.supp"
fi
