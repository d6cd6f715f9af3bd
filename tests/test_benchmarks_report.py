"""benchmarks/report.py: the charts and tables of docs/benchmarks.md come out of the committed results."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "benchmarks" / "report.py"
# the newest results holding the default parts (later folders may hold single parts run on request)
RESULTS = sorted(p for p in (REPO / "benchmarks" / "results").iterdir() if (p / "micro").is_dir())[-1]


def test_the_committed_results_give_every_chart_and_the_tables(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPORT), str(RESULTS), "--charts", str(tmp_path), "--markdown"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    charts = sorted(p.name for p in tmp_path.iterdir())
    assert charts == [
        "forward-by-width.png",
        "rounds-by-budget.png",
        "serve-tokens-per-second.png",
        "smollm2-tokens-per-second.png",
    ]
    for chart in charts:
        assert (tmp_path / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (REPO / "docs" / "images" / chart).is_file(), "the page shows every chart"
    micro = json.loads((RESULTS / "micro" / "bench.json").read_text())["micro"]
    assert f"verify 33 / decode {micro['verify33_over_decode']['triton']}" in done.stdout
    flag = json.loads((RESULTS / "smollm2" / "bench.json").read_text())["recommended_budget"]["flag"]
    assert f"recommended: `{flag}`" in done.stdout
    assert flag.split()[1] in (REPO / "docs" / "benchmarks.md").read_text(), "the page quotes the recommendation"


def test_the_budget_auto_runs_give_the_tables_on_the_page():
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for folder in sorted((REPO / "benchmarks" / "results").glob("*/*/budget-auto")):
        done = subprocess.run(
            [sys.executable, str(REPORT), str(folder.parent), "--markdown"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        auto = next(line for line in done.stdout.splitlines() if line.startswith("| `auto` |"))
        assert auto.removeprefix("| `auto` |") in page, f"the page quotes {folder}'s auto row"


def test_a_folder_without_results_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(REPORT), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"report: no benchmark output in {tmp_path}"
