#!/usr/bin/env bash
# The checks that need a GPU, one step per call of the device tool, each written under OUTDIR as
# it runs:
#
#     benchmarks/gpu_run.sh STEP OUTDIR
#
# A device call may run 10 minutes and a session has 15 minutes of device time, the machine's
# start included, so each step
# ends within STEP_LIMIT seconds (default 420, all its commands together) and writes
# OUTDIR/<step>-<gpu>.txt line by line: a step cut short still returns what it wrote. The
# steps, in the order of the standing GPU validation issue (#15):
#
#   cuda-tests            The `cuda`-marked tests (values against the CPU reference, #13's
#                         corruption tests, one side stream, flat reserved memory, the CUDA
#                         sanitizer run and its planted-race control, resume on the device, the
#                         two-GPU tests where there are two), then all of tests/test_device*.py,
#                         whose fakes meet a real CUDA build of torch here.      (#15 runs 1-2)
#   cuda-tests-sanitized  The same under TORCH_CUDA_SANITIZER=1: all pass, the planted
#                         controls fail as designed.                             (#15 run 1)
#   bench                 `python -m prefetchx bench`, whole (it has --cpu-only but no flag for
#                         the CUDA section alone; on the H200's host the CPU part took over
#                         110 s at 46e88dd): copy bandwidth and the end-to-end step. Also
#                         OUTDIR/bench-<gpu>.json.
#                                                                                (#15 runs 3-4)
#   bench-quick           `python -m prefetchx bench --quick`: the same CUDA section whole,
#                         after a CPU part of about 15 s and no JPEG rows. For a session short
#                         of time: at 46e88dd the whole bench outgrew 110 s in its JPEG rows,
#                         before its CUDA section began.                         (#15 runs 3-4)
#   new-loaders           benchmarks/new_loader.py (issue #64's cells but the 200-item demo, 5
#                         rounds) on the host's CPUs, then benchmarks/gpu/new_loader_step.py: a
#                         new loader's first epoch in the end-to-end step against apex-style
#                         and timm-style prefetchers, 9 paired rounds.          (#67 run 2)
#   scripts               benchmarks/gpu/memory.py, step_options.py and threads.py, one after
#                         another into the one file: memory over 20 epochs and after a break,
#                         the compute-bound step and the options, the main thread's torch
#                         thread counts against DataLoader's.                 (#15 runs 4-7)
#   paired                benchmarks/gpu/step_paired.py: the bench's end-to-end step with 13
#                         paired rounds, each arm against apex-style in the same round, and
#                         DataLoaderX without its thread and with device_prefetch=2. The
#                         bench's 5 unpaired medians cannot tell a 1% gap from noise; this
#                         can. Also max_prefetch=0 with pin_memory=True.         (#15 run 4)
#   suite                 Every other test. Not in the plan: outside `cuda`-marked tests the
#                         machine looks like one without an accelerator (conftest.py), so these
#                         re-test the CPU path that CI runs and that was recorded with this
#                         image's torch and Python (benchmarks/results/compat-cpu-2core.txt),
#                         for minutes of the session's 30. Run it only with time to spare.
#
# Each .txt starts with a line naming the GPU, driver, torch, Python and commit; copy the files
# to benchmarks/results/ and commit them. The exit status is pytest's or the bench's; 2 for a bad
# call or no CUDA device; 124 when the step ran out of time.
#
# On the device tool's machine (torch 2.11, Python 3.12, no network) only prefetch_generator is
# missing. Build its wheel here into .whl/ (ignored by git, so it must be carried), and name the
# commit: the machine's copy of .git may name an older one (the bench believes PREFETCHX_COMMIT
# first). On the H200 at 46e88dd paired took about 150 s, the two test steps 180 s and scripts
# 95 s; the whole bench needs over 110 s on that host (at 1abc908 it took 92 s), while its CUDA
# section alone took about 45 s, so bench-quick about 60 s. One call of paired, both test
# steps, bench-quick and scripts (about 500 s) fits a session's 15 minutes with the machine's
# start; a second call of two minutes still fits. (benchmarks/jpeg_pipeline.py, a CPU
# benchmark, did 4 of its 6 configurations in 190 s on that host with --images 256: give it
# --threads or --workers to fit.)
#
#     pip wheel --no-deps prefetch_generator==1.0.3 -w .whl
#     run(command="export PREFETCHX_COMMIT=<sha>; STEP_LIMIT=150 benchmarks/gpu_run.sh paired $OUT; STEP_LIMIT=110 benchmarks/gpu_run.sh cuda-tests $OUT; STEP_LIMIT=80 benchmarks/gpu_run.sh cuda-tests-sanitized $OUT; STEP_LIMIT=110 benchmarks/gpu_run.sh bench-quick $OUT; STEP_LIMIT=95 benchmarks/gpu_run.sh scripts $OUT", carry=[".whl"], timeout_s=570)
set -uo pipefail

usage() {
    echo "usage: benchmarks/gpu_run.sh STEP OUTDIR" >&2
    echo "  STEP: cuda-tests, cuda-tests-sanitized, new-loaders, bench, bench-quick, scripts, paired or suite" >&2
    echo "  (see the header)" >&2
    exit 2
}

[ $# -eq 2 ] || usage
step=$1
case "$step" in
cuda-tests | cuda-tests-sanitized | new-loaders | bench | bench-quick | scripts | paired | suite) ;;
*) usage ;;
esac
out=$2
python=${PYTHON:-python3}
limit=${STEP_LIMIT:-420}
deadline=$((SECONDS + limit))

cd "$(dirname "$0")/.."

gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")')
if [ -z "$gpu" ]; then
    echo "gpu_run.sh: no CUDA device here (torch.cuda.is_available() is False)" >&2
    exit 2
fi

mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)

if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/prefetchx-site \
        .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/prefetchx-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PREFETCHX_COMMIT=${PREFETCHX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PREFETCHX_COMMIT

slug=$(printf '%s' "$gpu" | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
versions=$("$python" -c 'import platform, torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}")')
header="# $step: $gpu (driver ${driver:-unknown}), $versions, commit $PREFETCHX_COMMIT, $(date -u +%Y-%m-%dT%H:%MZ)"
file="$out/$step-$slug.txt"

# Within what is left of the step's limit; SIGINT first, so pytest prints its summary of what
# ran, then SIGKILL 20 s later.
capped() {
    local left=$((deadline - SECONDS))
    if [ "$left" -le 0 ]; then
        echo "gpu_run.sh: $step has used its $limit s; not run: $*"
        return 124
    fi
    timeout --signal=INT --kill-after=20 "$left" "$@"
}
# Run "$@" with its output appended to the step's file as it comes; keep the first failure.
logged() {
    "$@" 2>&1 | tee -a "$file"
    local status=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then rc=$status; fi
}
# --durations: what each test took, to plan the next session's steps. -p no:xdist: one process,
# so that the tests have the GPU and its memory to themselves, where pytest-xdist is installed.
run_pytest() {
    logged capped "$python" -m pytest -v -ra --durations=15 -p no:cacheprovider -p no:xdist "$@"
}

echo "$header" >"$file"
rc=0
case "$step" in
cuda-tests)
    run_pytest -m cuda tests
    run_pytest -m "not cuda" tests/test_device*.py
    ;;
cuda-tests-sanitized)
    # Not the docs' and examples' samples: they start DataLoader workers, and under the
    # sanitizer every op (a worker's too) asks for the current CUDA stream, which a forked
    # worker cannot initialize. The unsanitized step runs them.
    TORCH_CUDA_SANITIZER=1 run_pytest -m cuda tests \
        --ignore tests/test_docs.py --ignore tests/test_examples.py
    ;;
new-loaders)
    # Issue #64's new-loader cells on the host's CPUs (the 200-item demo left out: 6 minutes),
    # then a new loader's first epoch in the end-to-end step against apex and timm's prefetchers.
    logged capped "$python" benchmarks/new_loader.py --rounds 5 --only '^(?!seed demo, 200)' \
        --out "$out/new_loader-$slug"
    logged capped "$python" benchmarks/gpu/new_loader_step.py --rounds 9
    ;;
bench)
    logged capped "$python" -m prefetchx bench --json "$out/bench-$slug.json"
    ;;
bench-quick)
    logged capped "$python" -m prefetchx bench --quick --json "$out/bench-quick-$slug.json"
    ;;
scripts)
    for script in memory step_options threads; do
        echo "## python benchmarks/gpu/$script.py" | tee -a "$file"
        logged capped "$python" "benchmarks/gpu/$script.py"
    done
    ;;
paired)
    logged capped "$python" benchmarks/gpu/step_paired.py --rounds 13
    ;;
suite)
    ignored=()
    for f in tests/test_device*.py; do ignored+=(--ignore "$f"); done
    run_pytest -m "not cuda" "${ignored[@]}"
    ;;
esac
exit "$rc"
