"""benchmarks/gpu_run.sh and the subprocess helpers of the GPU tests, on a machine without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, by_path, repo_env, run_python

SCRIPT = Path(REPO) / "benchmarks" / "gpu_run.sh"
STEPS = ["cuda-tests", "cuda-tests-sanitized", "bench", "bench-quick", "scripts", "paired", "suite"]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}  # the interpreter with this torch
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "args", [(), ("cuda-tests",), ("tests", "out"), ("--help", "out"), ("bench", "out", "more")]
)
def test_a_bad_call_prints_the_usage_and_exits_2(args: tuple[str, ...], tmp_path: Path) -> None:
    done = _run(*(str(tmp_path / a) if a == "out" else a for a in args), cwd=tmp_path)
    assert done.returncode == 2
    assert "usage: benchmarks/gpu_run.sh STEP OUTDIR" in done.stderr
    steps = "cuda-tests, cuda-tests-sanitized, new-loaders, bench, bench-quick, scripts, paired"
    assert f"{steps} or suite" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("step", STEPS)
def test_every_step_stops_without_a_cuda_device(step: str, tmp_path: Path) -> None:
    # Outside `cuda`-marked tests no CUDA device is visible, a GPU machine included (conftest.py).
    out = tmp_path / "out"
    done = _run(step, str(out), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "gpu_run.sh: no CUDA device here" in done.stderr
    assert not out.exists()  # nothing was started or written


def test_a_child_imports_the_gpu_tests_helpers_past_an_installed_tests_package(
    tmp_path: Path,
) -> None:
    # An installed distribution that ships a top-level `tests` package (a regular one, with an
    # __init__.py) wins `import tests....` over this repository's, which has none.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    env = repo_env(PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    shadowed = run_python("from tests.test_cuda import Images", env)  # the control: as it was
    assert shadowed.returncode != 0
    assert "No module named 'tests.test_cuda'" in shadowed.stderr
    test_cuda = os.path.join(REPO, "tests", "test_cuda.py")
    loaded = run_python(
        f"{by_path(test_cuda, 'Images', 'MEAN')}\nprint(len(Images(5)), MEAN[0])", env
    )
    assert loaded.returncode == 0, loaded.stderr[-4000:]
    assert loaded.stdout.split() == ["5", "123.675"]
