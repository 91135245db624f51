"""The distributions: the sdist carries a test tree that runs, the metadata tells the truth."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.helpers import needs_records

ROOT = Path(__file__).resolve().parent.parent

NEEDED_BY_TESTS = ["tests", "docs", "examples", "benchmarks", "conftest.py", "CHANGELOG.md"]
"""What `pytest` in an unpacked sdist reads besides the package: its helpers and fixtures, the
pages whose samples it runs, the example it launches, the benchmark programs it runs."""

RECORDS = "benchmarks/results/"
"""The recorded runs: the repository's, not the sdist's (the tests that read them skip there)."""


def _files(*names: str) -> set[str]:
    found = set()
    for name in names:
        path = ROOT / name
        if path.is_file():
            found.add(name)
        for folder, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found.update(os.path.relpath(os.path.join(folder, f), ROOT) for f in files)
    return {f.replace(os.sep, "/") for f in found}


def test_the_sdist_manifest_takes_every_file_the_tests_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    egg_info = pytest.importorskip("setuptools.command.egg_info")
    monkeypatch.chdir(ROOT)  # the manifest's patterns are relative to the project
    manifest = egg_info.FileList()
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            manifest.process_template_line(line)
    taken = {f.replace(os.sep, "/") for f in manifest.files}
    needed = {f for f in _files(*NEEDED_BY_TESTS) if not f.startswith(RECORDS)}
    assert "tests/helpers.py" in needed
    assert not needed - taken, sorted(needed - taken)
    assert not [f for f in taken if f.startswith(RECORDS)]
    assert not [f for f in taken if f.endswith((".pyc", ".pyo"))]


@needs_records
def test_the_classifiers_name_the_python_versions_the_suite_passed_on() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    record = (ROOT / "benchmarks" / "results" / "compat-cpu-2core.txt").read_text()
    passed = sorted(
        {m[1] for m in re.finditer(r"^Python (3\.\d+)\.\d+ .* passed", record, re.M)},
        key=lambda v: int(v.split(".")[1]),
    )
    prefix = "Programming Language :: Python :: "
    named = [c.removeprefix(prefix) for c in project["classifiers"] if c.startswith(prefix + "3.")]
    assert named == passed
    assert project["requires-python"] == f">={passed[0]}"
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "prefetchx" / "py.typed").is_file()


def test_the_bench_extra_brings_what_the_bench_needs_and_dev_has_it_too() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["bench"] == ["pillow>=10", "matplotlib>=3.7"]  # the JPEG workload, --plot
    assert set(extras["bench"]) <= set(extras["dev"])
    assert set(extras["plot"]) <= set(extras["bench"])


def test_the_authors_are_the_holder_the_license_names() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (holder,) = re.findall(r"Copyright \(c\) \d{4} (.+)", (ROOT / "LICENSE").read_text())
    assert project["authors"] == [{"name": holder}]
