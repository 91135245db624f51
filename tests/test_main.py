"""The `prefetchx` command (`python -m prefetchx`): its version, its help, its entry point."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prefetchx
from prefetchx.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


def test_version_names_prefetchx_torch_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"prefetchx {prefetchx.__version__} (torch {torch.__version__}, ")
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}." in out


def test_python_dash_m_prefetchx_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefetchx", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"prefetchx {prefetchx.__version__} ")


def test_the_console_script_is_this_main() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["prefetchx"].partition(":")
    assert getattr(importlib.import_module(module), name) is main


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"]])
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: prefetchx")
    assert "`" not in out  # no reST markup: argparse shows it raw
    assert "--version" in out or "--max-prefetch N" in out


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main([])
    assert exit.value.code == 2
    assert "required: COMMAND" in capsys.readouterr().err
