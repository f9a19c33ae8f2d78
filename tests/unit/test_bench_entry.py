"""One list of benchmarks (bench/__main__.py): ``python -m bench`` shows it, ``make bench`` runs
``python -m bench all``, ``llmesh bench`` hands over to ``python -m bench`` in a checkout."""

import subprocess
import sys
from pathlib import Path

from bench.__main__ import BENCHES

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_every_listed_benchmark_is_a_module_and_the_list_is_shown():
    assert all((ROOT / "bench" / f"{b.name}.py").is_file() for b in BENCHES)
    shown = run("bench", "--list")
    assert shown.returncode == 0
    listed = [line.split()[0] for line in shown.stdout.split("Benchmarks:\n")[1].splitlines()]
    assert listed == [b.name for b in BENCHES]
    assert run("llmesh", "bench", "--list").stdout == shown.stdout  # the CLI's verb is the same list


def test_an_unknown_benchmark_is_refused_with_the_list():
    done = run("bench", "nosuch")
    assert done.returncode == 2 and "no benchmark 'nosuch'" in done.stderr and "routing" in done.stderr


def test_make_bench_runs_the_full_list():
    assert "$(BIN)/python -m bench all\n" in (ROOT / "Makefile").read_text()


def test_llmesh_bench_outside_a_checkout_says_where_to_run_it(tmp_path):
    done = run("llmesh", "bench", "guards", cwd=tmp_path)
    assert done.returncode == 2 and "cd there first" in done.stderr
