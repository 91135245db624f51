#!/usr/bin/env bash
# Every check that needs a GPU, in one command, its output written under OUTDIR:
#
#     benchmarks/gpu_run.sh OUTDIR
#
# 1. The whole test suite. The `cuda`-marked tests (values against the CPU reference, devices,
#    one side stream, flat reserved memory, the CUDA sanitizer run and its planted-race
#    control, resume on the device, the two-GPU tests where there are two) see the GPU; the
#    others run as on a CPU machine (conftest.py). Written to OUTDIR/tests-<gpu>.txt.
# 2. `python -m prefetchx bench`, CUDA section included: OUTDIR/bench-<gpu>.{txt,json}.
#
# Each .txt starts with a line naming the GPU, driver, torch, Python and commit; copy the files
# to benchmarks/results/ and commit them.
#
# On the device tool's machine (torch 2.11, Python 3.12, no network, no .git) only
# prefetch_generator is missing. Build its wheel here into .whl/ (ignored by git, so it must be
# carried), and name the commit:
#
#     pip wheel --no-deps prefetch_generator==1.0.3 -w .whl
#     run(command="PREFETCHX_COMMIT=<sha> benchmarks/gpu_run.sh $OUT", carry=[".whl"])
set -uo pipefail

out=${1:?usage: benchmarks/gpu_run.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/prefetchx-site \
        .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/prefetchx-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PREFETCHX_COMMIT=${PREFETCHX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PREFETCHX_COMMIT

gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")')
if [ -z "$gpu" ]; then
    echo "gpu_run.sh: no CUDA device here" >&2
    exit 2
fi
slug=$(printf '%s' "$gpu" | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
header="# $gpu (driver ${driver:-unknown}), $(python3 -c 'import platform, torch; print(f"torch {torch.__version__}, Python {platform.python_version()}")'), commit $PREFETCHX_COMMIT, $(date -u +%Y-%m-%dT%H:%MZ)"

rc=0
{ echo "$header"; python3 -m pytest -v -ra -p no:cacheprovider 2>&1; } | tee "$out/tests-$slug.txt" || rc=1
{ echo "$header"; python3 -m prefetchx bench --json "$out/bench-$slug.json" 2>&1; } | tee "$out/bench-$slug.txt" || rc=1
exit $rc
