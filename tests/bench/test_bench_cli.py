"""``minipaged bench NAME [ARGS...]`` (``minipaged.bench.main``), and the size of
the package's benchmarks."""

import ast
import json
from pathlib import Path

import pytest

import minipaged.bench as bench

BENCH_DIR = Path(bench.__file__).parent
# Every line of minipaged/bench/*.py; one-off drivers go to scripts/. 3200 until the
# HTTP load client (serve_client.py, `minipaged bench serve`) came in, 3650 until the
# host benchmark's stand-in got text-like output (rare_bytes_bias, --text).
MAX_LINES = 3675


def test_without_a_name_it_lists_every_benchmark_on_one_line_each(capsys):
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    for name, what in bench.BENCHMARKS.items():
        [line] = [ln for ln in out.splitlines() if ln.split()[:1] == [name]]
        assert what in line
    assert bench.main(["--help"]) == 0 and capsys.readouterr().out == out


def test_an_unknown_name_exits_2_with_the_list(capsys):
    assert bench.main(["nope", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and all(name in err for name in bench.BENCHMARKS)


def test_every_benchmark_is_listed_and_has_a_main():
    # Every module that runs as ``python -m minipaged.bench.NAME`` is in the list,
    # and nothing else is.
    scripts = {p.stem for p in BENCH_DIR.glob("*.py")
               if 'if __name__ == "__main__":' in p.read_text()}
    assert scripts == {bench.module_name(name) for name in bench.BENCHMARKS}
    for name in bench.BENCHMARKS:
        tree = ast.parse((BENCH_DIR / f"{bench.module_name(name)}.py").read_text())
        [main] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert [a.arg for a in main.args.args] == ["argv"] and main.args.defaults, name


def test_a_benchmark_runs_through_the_dispatcher(tmp_path):
    out = tmp_path / "host.json"
    code = bench.main(["host-overhead", "--batches", "8", "--lengths", "4", "12",
                       "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "host_overhead" and set(record["results"]["8"]) == {"4", "12"}


def test_a_benchmarks_own_options_error_exits_as_argparse_does(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["memory_waste", "--no-such-option"])
    assert exit_.value.code == 2


def test_the_package_benchmarks_stay_within_their_line_budget():
    lines = {p.name: p.read_bytes().count(b"\n") for p in sorted(BENCH_DIR.glob("*.py"))}
    assert sum(lines.values()) <= MAX_LINES, (
        f"minipaged/bench/ has {sum(lines.values())} lines, more than {MAX_LINES}: move "
        f"records of past experiments and one-off drivers to scripts/ ({lines})")
