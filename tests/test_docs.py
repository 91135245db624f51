"""Every code sample of the documentation runs, so the docs cannot drift from the code.

A page's ```python fences run in order in one namespace, as a reader would paste them; its
```pycon fences are doctests in that same namespace, so their shown output is checked too. A fence
whose first line is ``# docs: needs cuda`` (or ``# docs: needs <module>``, comma-separated) is
left out of its page's run and gets a test of its own, which runs the page's plain samples before
it and then the fence, and is skipped, with the reason, only where the requirement is missing.

Each run is a fresh interpreter, as a reader's script would be: samples may start worker
processes (with ``spawn`` too), which leave helpers such as multiprocessing's resource tracker
behind in the process that started them. It fails when the samples leave a ``prefetchx-*`` thread
or a worker process running, by the shared fixture's own check.
"""

from __future__ import annotations

import doctest
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import prefetchx
from prefetchx import DataLoaderX
from tests.helpers import needs_records

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]

SAMPLE_TIMEOUT = 60
"""Seconds a page's samples may take in all; each page is meant to run in a few."""

LEAK_WAIT = 5.0
"""Seconds a page's threads and workers get to end after its samples; they end in milliseconds."""

RUNNABLE = ("python", "pycon")
"""Fence languages that are executed; other spellings of Python are refused, not skipped."""

OTHER_PYTHON = ("py", "python3", "ipython", "pycon3")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_NEEDS = re.compile(r"^(?:>>> )?#\s*docs:\s*needs\s+(?P<needs>.+?)\s*$")


@dataclass(frozen=True)
class Sample:
    """One fenced code block of a page."""

    path: Path
    line: int
    """1-based line, in the page, of the sample's first line of code."""
    lang: str
    code: str
    needs: tuple[str, ...]

    @property
    def where(self) -> str:
        page = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{page}:{self.line}"


def extract(text: str, path: Path) -> list[Sample]:
    """Every fenced block of a Markdown text, indented ones (tabs, admonitions) included."""
    samples = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None or not opening["info"]:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        lang = opening["info"].split()[0].strip("{}.").lower()
        body = []
        i += 1
        start = i + 1  # 1-based line of the first line of code
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if (
                closing is not None
                and not closing["info"]
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
            ):
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        code = textwrap.dedent("\n".join(body)) + "\n"
        first = code.splitlines()[0] if code.strip() else ""
        marker = _NEEDS.match(first)
        needs = tuple(n.strip() for n in marker["needs"].split(",")) if marker else ()
        samples.append(Sample(path, start, lang, code, needs))
        i += 1
    return samples


def page_samples(path: Path) -> list[Sample]:
    return [s for s in extract(path.read_text(), path) if s.lang in RUNNABLE]


def missing(needs: tuple[str, ...]) -> list[str]:
    """The requirements of a sample that this machine lacks."""
    out = []
    for need in needs:
        if need == "cuda":
            if not torch.cuda.is_available():
                out.append("a CUDA device")
        elif not all(part.isidentifier() for part in need.split(".")):
            raise ValueError(f"`# docs: needs {need}`: name `cuda` or an importable module.")
        elif importlib.util.find_spec(need.partition(".")[0]) is None:
            out.append(f"the `{need.partition('.')[0]}` package")
        elif "." in need:  # a submodule: one that imports here (its package may need newer torch)
            try:
                importlib.import_module(need)
            except Exception as exc:
                out.append(f"a `{need}` that imports here ({type(exc).__name__}: {exc})")
    return out


def run_samples(samples: list[Sample]) -> None:
    """Run ``samples`` in order in one fresh namespace, as one script of a page."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    for sample in samples:
        if sample.lang == "python":
            # Padded to the sample's line, so a traceback names the page and the line.
            padded = "\n" * (sample.line - 1) + sample.code
            exec(compile(padded, str(sample.path), "exec"), namespace)
            continue
        test = doctest.DocTestParser().get_doctest(
            sample.code, namespace, sample.where, str(sample.path), sample.line - 1
        )
        if not test.examples:
            pytest.fail(f"pycon sample at {sample.where} has no `>>> ` example")
        report: list[str] = []
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=report.append, clear_globs=False)
        namespace.update(test.globs)  # the doctest ran in a copy of the namespace
        if runner.failures:
            pytest.fail(f"pycon sample at {sample.where} failed:\n{''.join(report)}")


def main(argv: list[str]) -> None:
    """In a fresh interpreter: run the samples of page ``argv[1]`` at lines ``argv[2:]``, then
    wait up to ``argv[0]`` seconds for their threads and workers to end."""
    from conftest import leftovers  # the repository root is on the path of this interpreter

    wait, path, lines = float(argv[0]), Path(argv[1]), {int(line) for line in argv[2:]}
    run_samples([s for s in page_samples(path) if s.line in lines])
    threads, workers = leftovers(before=set(), wait=wait)
    if threads or workers:
        sys.exit(f"{path}: the samples leaked threads {threads} and worker processes {workers}")


def run_in_subprocess(
    path: Path, samples: list[Sample], leak_wait: float = LEAK_WAIT
) -> subprocess.CompletedProcess[str]:
    """Run ``samples`` of ``path`` with `main` in a new interpreter; fail the test if it fails."""
    # -c, not a file: spawned workers then have no __main__ file to import again.
    code = "import sys; sys.path[:0] = sys.argv[1:3]; import test_docs as t; t.main(sys.argv[3:])"
    argv = [str(ROOT), str(ROOT / "tests"), str(leak_wait), str(path)]
    argv += [str(s.line) for s in samples]
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SAMPLE_TIMEOUT,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"samples of {path.name} failed:\n{result.stdout}\n{result.stderr}")
    return result


def _params() -> tuple[list[object], list[object]]:
    pages, gated = [], []
    for path in PAGES:
        samples = page_samples(path)
        name = str(path.relative_to(ROOT))
        if any(not s.needs for s in samples):
            pages.append(pytest.param(path, id=name))
        gated.extend(
            pytest.param(
                path, s.line, id=s.where, marks=pytest.mark.cuda if "cuda" in s.needs else ()
            )
            for s in samples
            if s.needs
        )
    return pages, gated


PAGE_PARAMS, GATED_PARAMS = _params()


@pytest.mark.parametrize("path", PAGE_PARAMS)
def test_page_samples_run(path: Path) -> None:
    run_in_subprocess(path, [s for s in page_samples(path) if not s.needs])


@pytest.mark.parametrize(("path", "line"), GATED_PARAMS)
def test_gated_sample_runs(path: Path, line: int) -> None:
    samples = page_samples(path)
    sample = next(s for s in samples if s.line == line)
    lacking = missing(sample.needs)
    if lacking:
        pytest.skip(f"{sample.where} needs {' and '.join(lacking)}")
    run_in_subprocess(path, [s for s in samples if not s.needs and s.line < line] + [sample])


def test_every_page_with_code_has_runnable_samples() -> None:
    # The pages that must show code; a broken extractor would find none and run nothing.
    for name in ("index", "migration", "configuration", "is-prefetching-helping", "design", "faq"):
        samples = page_samples(DOCS / f"{name}.md")
        assert any(not s.needs for s in samples), f"docs/{name}.md has no sample that runs here"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_fences_are_spelled_python(path: Path) -> None:
    # Another spelling would be rendered as Python but never run.
    spelled = [s.where for s in extract(path.read_text(), path) if s.lang in OTHER_PYTHON]
    assert not spelled, f"use ```python or ```pycon at {spelled}"


def test_extract_finds_indented_fences_markers_and_lines(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    text = (
        "Text\n"
        "\n"
        '=== "After"\n'
        "\n"
        "    ```python\n"
        "    # docs: needs cuda, timm\n"
        "    x = 1\n"
        "    ```\n"
        "\n"
        "````markdown\n"
        "```python\n"
        "not a sample\n"
        "```\n"
        "````\n"
        "```bash\n"
        "pytest\n"
        "```\n"
        "```pycon\n"
        ">>> 1 + 1\n"
        "2\n"
        "```\n"
    )
    samples = extract(text, page)
    assert [(s.lang, s.line, s.needs) for s in samples] == [
        ("python", 6, ("cuda", "timm")),
        ("markdown", 11, ()),
        ("bash", 16, ()),
        ("pycon", 19, ()),
    ]
    assert samples[0].code == "# docs: needs cuda, timm\nx = 1\n"


def test_missing_names_cuda_and_packages() -> None:
    assert missing(("pytest",)) == []
    assert missing(("no_such_module_prefetchx",)) == ["the `no_such_module_prefetchx` package"]
    assert missing(("cuda",)) == ([] if torch.cuda.is_available() else ["a CUDA device"])
    with pytest.raises(ValueError, match="needs cuda-12"):
        missing(("cuda-12",))


def test_run_samples_reports_the_page_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nraise KeyError(x)\n```\n")
    with pytest.raises(KeyError) as info:
        run_samples(page_samples(page))
    last = info.traceback[-1]
    assert (Path(str(last.path)), last.lineno + 1) == (page, 6)


def test_a_failing_sample_fails_its_page_with_the_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'wrong x'\n```\n")
    with pytest.raises(pytest.fail.Exception, match=r'(?s)page\.md", line 6.*wrong x'):
        run_in_subprocess(page, page_samples(page))


def test_a_sample_that_leaks_its_thread_fails_its_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    # A thread that outlives every reference to its loader: only a real leak is reported.
    page.write_text(
        "```python\n"
        "import threading\n"
        "threading.Thread(target=threading.Event().wait, args=(30,), name='prefetchx-x',\n"
        "                 daemon=True).start()\n"
        "```\n"
    )
    with pytest.raises(pytest.fail.Exception, match=r"leaked threads \['prefetchx-x'\]"):
        run_in_subprocess(page, page_samples(page), leak_wait=0.5)


def test_run_samples_checks_pycon_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 2\n```\n```pycon\n>>> x + 1\n4\n```\n")
    with pytest.raises(pytest.fail.Exception, match="Expected:\n    4\nGot:\n    3"):
        run_samples(page_samples(page))


def test_configuration_page_documents_every_prefetch_argument() -> None:
    text = (DOCS / "configuration.md").read_text()
    theirs = inspect.signature(DataLoader.__init__).parameters
    ours = [p for p in inspect.signature(DataLoaderX).parameters.values() if p.name not in theirs]
    assert len(ours) == 9
    sections = {
        heading: body for heading, body in (s.split("\n", 1) for s in text.split("\n### ")[1:])
    }
    for parameter in ours:
        found = [body for heading, body in sections.items() if f"`{parameter.name}`" in heading]
        assert found, f"docs/configuration.md has no ### section for `{parameter.name}`"
        assert f"Default: `{parameter.default!r}`" in found[0], parameter.name


def test_api_page_lists_exactly_the_public_names() -> None:
    text = (DOCS / "api.md").read_text()
    listed = re.findall(r"^::: prefetchx\.(\w+)$", text, flags=re.MULTILINE)
    assert listed == prefetchx.__all__


def test_changelog_page_includes_the_changelog_itself() -> None:
    assert (DOCS / "changelog.md").read_text().strip() == '--8<-- "CHANGELOG.md"'


def test_readme_needs_no_link_relative_to_the_repository() -> None:
    # The README is the package index's long description, where such a link is dead: it names
    # the files instead, and each one it names exists.
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)]*)\)", readme) + re.findall(r"(?:src|href)=\"([^\"]*)", readme)
    assert [t for t in targets if not t.startswith("https://")] == []
    named = re.findall(r"`((?:docs|examples|benchmarks|tests)/[^`\s]+|CHANGELOG\.md)`", readme)
    assert len({n for n in named if n.startswith("docs/")}) >= 7
    for name in named:
        assert (ROOT / name).exists(), name


@needs_records
def test_the_plot_on_the_site_is_the_recorded_runs_own() -> None:
    # The page shows the plot that benchmarks/plot.py drew from the recorded run, and the
    # record's table and JSON name one commit.
    page = (DOCS / "is-prefetching-helping.md").read_text()
    assert "](assets/bench-cpu-2core.png)" in page
    stem = ROOT / "benchmarks" / "results" / "bench-cpu-2core"
    commit = json.loads(stem.with_suffix(".json").read_text())["meta"]["commit"]
    assert f"commit {commit}" in stem.with_suffix(".txt").read_text().splitlines()[0]
    shown = (DOCS / "assets" / "bench-cpu-2core.png").read_bytes()
    # Digests, not bytes: pytest's diff of two differing images outlasts the test's timeout.
    assert sha256(shown).hexdigest() == sha256(stem.with_suffix(".png").read_bytes()).hexdigest()


def test_readme_two_commands_stay_the_install_and_the_tests() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## The two commands\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)\n```$", section, flags=re.MULTILINE | re.DOTALL)
    # The CPU build of torch comes first, for machines without a GPU: installed after the first
    # command, it would come after gigabytes of PyPI's CUDA build.
    assert blocks == [
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
        'pip install -e ".[dev]" && python -m prefetchx bench',
        "pytest",
    ]
    # The first screen says what it is, who needs it and how long the main job takes.
    first_screen = readme.split("\n## The two commands\n", 1)[0]
    assert "DataLoader" in first_screen
    assert "GPU" in first_screen
    assert re.search(r"about \d+\s+minutes", section)


def test_the_site_carries_the_mermaid_that_material_would_fetch() -> None:
    # The Design page's diagrams render offline only with this script: without it,
    # mkdocs-material fetches mermaid from a CDN and, offline, shows the diagrams' source.
    config = (ROOT / "mkdocs.yml").read_text()
    vendored = DOCS / "assets" / "vendor" / "mermaid"
    assert "extra_javascript:\n  - assets/vendor/mermaid/mermaid.min.js\n" in config
    assert "MIT License" in (vendored / "LICENSE").read_text()
    script = (vendored / "mermaid.min.js").read_text()
    version = re.findall(r'=\{version:"(\d+\.\d+\.\d+)"\}', script)  # mermaid's getVersion()
    assert len(version) == 1
    assert config.count(version[0]) == 2  # the footer's notice and the comment name it
    material = pytest.importorskip("material")
    bundle = next((Path(material.__file__).parent / "templates").rglob("bundle.*.min.js"))
    wanted = re.findall(r"unpkg\.com/mermaid@(\d+)/", bundle.read_text())
    assert wanted == [version[0].split(".")[0]], "material now loads another major version"


PENDING_IN_LOADER: set[str] = set()
"""Private names left in prefetchx/_loader.py's docstrings: none (issue #17)."""


def _shown(obj: Any, where: str) -> Iterator[tuple[str, str]]:
    """(where, docstring) of ``obj`` and of every member the API page shows with it."""
    if obj.docstring is not None:
        yield where, obj.docstring.value
    for name, member in obj.members.items():
        if not name.startswith("_") and not member.is_alias and member.docstring is not None:
            yield from _shown(member, f"{where}.{name}")


def test_the_api_reference_names_no_private_object() -> None:
    griffe = pytest.importorskip("griffe")  # what mkdocstrings reads the docstrings with
    package = griffe.load("prefetchx", search_paths=[str(ROOT)])
    private = {
        name
        for module in package.modules.values()
        if module.name.startswith("_")
        for name, member in module.members.items()
        if not member.is_alias
        and name not in prefetchx.__all__
        and (member.is_class or name.isupper() or name.startswith("_"))
    }
    assert {"PrefetchIterator", "Series", "JOIN_TIMEOUT"} <= private
    found = set()
    for public in prefetchx.__all__:
        for where, text in _shown(package[public].final_target, public):
            for code in re.findall(r"`+([^`]+?)`+", text):
                head = re.split(r"[.(\[ ]", code, maxsplit=1)[0]
                if "prefetchx._" in code or head in private or re.match(r"_[^_]", code):
                    found.add(f"{where}: {code}")
    assert found == PENDING_IN_LOADER


def test_the_numbers_the_reference_gives_are_the_constants() -> None:
    # It gives them instead of naming the private constants; this keeps them true.
    from prefetchx import _choose, _engine, _stats
    from prefetchx._loader import DataLoaderX
    from prefetchx._stats import EpochStats
    from prefetchx._thread_stage import ThreadStage

    def words(text: str | None) -> str:
        return " ".join((text or "").split())

    assert f"Waits up to {_engine.JOIN_TIMEOUT:g} s" in words(ThreadStage.close.__doc__)
    assert f"at most {_choose.BUDGET:.0%} of the loop's time" in words(DataLoaderX.__doc__)
    assert f"most recent {_stats.WINDOW} samples" in words(EpochStats.__doc__)
