"""The ``minipaged`` command: ``serve``, ``demo`` and ``bench`` dispatch to their
modules, as the console script and ``python -m minipaged`` both run it."""

import subprocess
import sys
from pathlib import Path

import pytest

from minipaged import cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_console_script_is_the_cli():
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    entries = [line for line in scripts.splitlines() if line and not line.startswith("#")]
    assert entries == ['minipaged = "minipaged.cli:main"']


def test_no_or_an_unknown_command_prints_the_usage(capsys):
    assert cli.main([]) == 2
    assert "minipaged serve" in capsys.readouterr().out
    assert cli.main(["launch"]) == 2
    assert "minipaged bench NAME" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_each_command_reaches_its_own_parser(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    assert f"usage: minipaged {command}" in capsys.readouterr().out


def test_bench_lists_the_benchmarks(capsys):
    assert cli.main(["bench"]) == 0
    listing = capsys.readouterr().out
    for name in ("memory_waste", "serving", "prefix", "structured"):
        assert name in listing


def test_python_dash_m_runs_the_same_command():
    run = subprocess.run([sys.executable, "-m", "minipaged", "bench"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "memory_waste" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "minipaged", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "usage: minipaged serve" in bad.stderr
