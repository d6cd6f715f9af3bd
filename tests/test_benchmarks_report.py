"""benchmarks/report.py: the charts and tables of docs/benchmarks.md come out of the committed results."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "benchmarks" / "report.py"
DEFAULT_PARTS = ("micro", "rounds", "smollm2", "serve")


def newest(part: str) -> Path:
    """The newest committed results folder holding `part` (parts are re-run on their own, on later dates)."""
    return sorted(p for p in (REPO / "benchmarks" / "results").iterdir() if (p / part).is_dir())[-1] / part


def test_the_committed_results_give_every_chart_and_the_tables(tmp_path):
    results, charts_dir = tmp_path / "results", tmp_path / "charts"
    for part in DEFAULT_PARTS:  # each part with its host.json: its own, or its folder's
        (results / part).mkdir(parents=True)
        for f in newest(part).iterdir():
            (results / part / f.name).symlink_to(f)
        if not (results / part / "host.json").exists():
            (results / part / "host.json").symlink_to(newest(part).parent / "host.json")
    charts_dir.mkdir()
    done = subprocess.run(
        [sys.executable, str(REPORT), str(results), "--charts", str(charts_dir), "--markdown"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    charts = sorted(p.name for p in charts_dir.iterdir())
    assert charts == [
        "forward-by-width.png",
        "rounds-by-budget.png",
        "serve-tokens-per-second.png",
        "smollm2-tokens-per-second.png",
    ]
    for chart in charts:
        assert (charts_dir / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (REPO / "docs" / "images" / chart).is_file(), "the page shows every chart"
    micro = json.loads((newest("micro") / "bench.json").read_text())["micro"]
    assert f"verify 33 / decode {micro['verify33_over_decode']['triton']}" in done.stdout
    flag = json.loads((newest("smollm2") / "bench.json").read_text())["recommended_budget"]["flag"]
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


def test_the_before_and_after_runs_give_the_spans_on_the_page():
    """Every committed `ab`-style folder (old-N and new-N runs of `ddtree bench`): report.py prints one
    line per configuration, and the page quotes the replays and ratios at the larger batch size of the
    ones it cites (`dflash` and `ddtree` B=8 where they ran, else every drafting method)."""
    page = " ".join((REPO / "docs" / "benchmarks.md").read_text().split())  # a figure may wrap
    folders = sorted({p.parent.parent for p in (REPO / "benchmarks" / "results").glob("*/*/new-*/bench.json")})
    assert folders, "the page's before/after figures have their runs committed"
    for folder in folders:
        done = subprocess.run(
            [sys.executable, str(REPORT), str(folder), "--markdown"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        lines = [line for line in done.stdout.splitlines() if line.startswith("| `")]
        batches = {line.split(" | ")[1] for line in lines}
        assert batches in ({"1", "16"}, {"1", "8"}), (folder, batches)
        if f"/{folder.name}/)" in page:  # the page links the runs themselves (not moe-bookkeeping for bookkeeping)
            larger = [line.split(" | ") for line in lines if line.split(" | ")[1] == max(batches, key=int)]
            drafting = [cells for cells in larger if cells[0] != "| `ar`"]
            quoted = [cells for cells in drafting if cells[0] in ("| `dflash`", "| `ddtree` B=8")] or drafting
            for cells in quoted:
                assert cells[2] in page and cells[3] in page, (folder.name, cells[:4])


def test_the_before_and_after_kernel_table_reads_each_runs_kernels():
    """The `ab` part's kernel table: the q/k norm + RoPE kernel of the batch-16 B=32 verify, whose change
    the qk-rope runs measured, with each side's span of its runs as their bench.json files hold it."""
    folder = REPO / "benchmarks" / "results" / "2026-12-04-h200" / "qk-rope"
    done = subprocess.run(
        [sys.executable, str(REPORT), str(folder), "--markdown"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kernel = "_qk_norm_rope_kv_kernel"
    row = next(
        line for line in done.stdout.splitlines() if line.startswith(f"| 16 | `ddtree` B=32 | verify | `{kernel}`")
    )
    spans = []
    for side in ("old", "new"):
        ms = []
        for path in sorted(folder.glob(f"{side}-*/bench.json")):
            for r in json.loads(path.read_text())["rows"]:
                if (r["method"], r["budget"], r["batch"]) == ("ddtree", 32, 16):
                    ms += [m for name, m, _ in r["graph_phases"]["phases"]["verify"]["heaviest"] if name == kernel]
        assert len(ms) == 2
        lo, hi = f"{min(ms):.3f}", f"{max(ms):.3f}"
        spans.append(lo if lo == hi else f"{lo}–{hi}")
    assert row.removesuffix(" |").split(" | ")[4:6] == spans, (row, spans)
