"""Charts and tables from the output folder of `benchmarks/gpu.sh` (or of `ddtree bench --out`).

    python3 benchmarks/report.py RESULTS_DIR [--charts docs/images] [--markdown]

Reads whatever parts are there (micro/, rounds/, smollm2/, serve/, first-pass/, host.json) and writes:
  smollm2-tokens-per-second.png  tokens/s against batch size for ar, dflash and ddtree (best budget)
  rounds-by-budget.png           round time against budget by batch size, ar and dflash as references
  serve-tokens-per-second.png    output tokens/s against concurrent clients behind `ddtree serve`
  forward-by-width.png           one target forward against the number of tokens, with the HBM bound
With --markdown, prints the tables of docs/benchmarks.md for the same data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METHODS = ("ar", "dflash", "ddtree")  # the tables' and charts' order
METHOD_COLOURS = {"ar": "#555555", "dflash": "#1f77b4", "ddtree": "#d62728"}


def load(results: Path) -> dict:
    """Every part present in `results`, parsed."""
    data: dict = {}
    for part in ("micro", "rounds", "smollm2"):
        path = results / part / "bench.json"
        if path.is_file():
            data[part] = json.loads(path.read_text())
    serve = {}
    for method in METHODS:
        path = results / "serve" / f"{method}.jsonl"
        if path.is_file() and path.stat().st_size:
            serve[method] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if serve:
        data["serve"] = serve
    # budget-auto/: one server per budget, NAME.jsonl with NAME budget-B (":" and "," of a policy as "x", "_")
    budgets = {}
    for path in sorted((results / "budget-auto").glob("budget-*.jsonl")):
        if not path.stem.endswith("-warmup") and path.stat().st_size:
            label = path.stem.removeprefix("budget-").replace("x", ":").replace("_", ",")
            budgets[label] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if budgets:
        data["budget_auto"] = budgets
    # first-pass/: gpu.sh's output, or one folder per commit compared (each with its host.json)
    first = results / "first-pass"
    runs = {}
    for folder in [first, *sorted(p for p in first.glob("*") if p.is_dir())]:
        passes = {}
        for method in ("ar", "ddtree"):
            for which in ("first", "second"):
                path = folder / f"{method}-{which}.jsonl"
                if path.is_file() and path.stat().st_size:
                    passes[(method, which)] = json.loads(path.read_text().splitlines()[0])
        if passes:
            host = folder / "host.json"
            runs[json.loads(host.read_text())["commit"] if host.is_file() else folder.name] = passes
    if runs:
        data["first_pass"] = runs
    # ab/ (or the folder itself): gpu.sh's `ab` part, `ddtree bench` runs of two trees alternated, old-N and
    # new-N; a run stopped at its limit may leave only rows.jsonl (the JSON lines it printed)
    for folder in (results / "ab", results):
        runs = {}
        for run in sorted(p for p in folder.glob("*-*") if p.is_dir() and p.name.split("-")[0] in ("old", "new")):
            if (run / "bench.json").is_file():
                runs[run.name] = json.loads((run / "bench.json").read_text())["rows"]
            elif (run / "rows.jsonl").is_file():
                runs[run.name] = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines() if line]
        if runs:
            data["ab"] = runs
            break
    # host.json: where and at which commit; a part run on its own has its own beside its output
    data["hosts"] = {}
    for part in ("", "micro", "rounds", "smollm2", "serve"):
        path = results / part / "host.json"
        if path.is_file():
            data["hosts"][part] = json.loads(path.read_text())
    return data


def timed_rows(bench: dict) -> list[dict]:
    """Rows with a time, CUDA-graph rows only when there are any (as `bench` recommends from); the fixed
    budgets' rows, not those of a --policy (their budget differs by batch size)."""
    rows = [r for r in bench.get("rows", []) if "tokens_per_second" in r and "policy" not in r]
    if any(r.get("graphs") for r in rows):
        rows = [r for r in rows if r.get("graphs")]
    variants = {r.get("kernels") for r in rows}
    if len(variants) > 1:  # `--kernels both`: the path the engine picks on CUDA
        rows = [r for r in rows if r.get("kernels") == ("triton" if "triton" in variants else sorted(variants)[0])]
    return rows


def best_by_batch(rows: list[dict], method: str) -> dict[int, dict]:
    """The fastest row of `method` at each batch size (for ddtree: over the budgets measured)."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["method"] == method and (
            r["batch"] not in best or r["tokens_per_second"] > best[r["batch"]]["tokens_per_second"]
        ):
            best[r["batch"]] = r
    return dict(sorted(best.items()))


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.grid(True, which="major", alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, ax, path: Path, xticks: list[int], **legend) -> bool:
    """Label the measured x values (log axes otherwise show powers of ten), add the legend, write the PNG."""
    if xticks:
        ax.set_xticks(xticks, [str(x) for x in xticks])
    ax.minorticks_off()
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _subtitle(data: dict, part: str) -> str:
    host = data["hosts"].get(part) or data["hosts"].get("", {})
    return ", ".join(str(host[k]) for k in ("gpu", "date", "commit") if host.get(k))


def chart_tokens_by_batch(data: dict, path: Path) -> bool:
    if "smollm2" not in data:
        return False
    rows = timed_rows(data["smollm2"])
    plt, fig, ax = _figure()
    for method in METHODS:
        best = best_by_batch(rows, method)
        if not best:
            continue
        ax.plot(
            list(best),
            [r["tokens_per_second"] for r in best.values()],
            marker="o",
            color=METHOD_COLOURS[method],
            label=method + (" (best budget)" if method == "ddtree" else ""),
        )
        if method == "ddtree":
            for batch, r in best.items():
                ax.annotate(
                    f"B={r['budget']}",
                    (batch, r["tokens_per_second"]),
                    textcoords="offset points",
                    xytext=(4, -12),
                    fontsize=8,
                    color=METHOD_COLOURS[method],
                )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="batch size (sequences)",
        ylabel="tokens/s",
        title="SmolLM2-135M-Instruct + shipped drafter\n" + _subtitle(data, "smollm2"),
    )
    return _save(plt, fig, ax, path, sorted({r["batch"] for r in rows}))


def chart_rounds_by_budget(data: dict, path: Path) -> bool:
    if "rounds" not in data:
        return False
    rows = timed_rows(data["rounds"])
    plt, fig, ax = _figure()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, batch in enumerate(sorted({r["batch"] for r in rows})):
        colour = colours[i % len(colours)]
        tree = sorted((r for r in rows if r["batch"] == batch and r["method"] == "ddtree"), key=lambda r: r["budget"])
        if tree:
            ax.plot(
                [r["budget"] for r in tree],
                [r["ms_per_round"] for r in tree],
                marker="o",
                color=colour,
                label=f"ddtree, batch {batch}",
            )
        for method, style in (("ar", ":"), ("dflash", "--")):
            ref = [r["ms_per_round"] for r in rows if r["batch"] == batch and r["method"] == method]
            if ref:
                ax.axhline(ref[0], linestyle=style, color=colour, alpha=0.7, label=f"{method}, batch {batch}")
    budgets = sorted({r["budget"] for r in rows if r["method"] == "ddtree"})
    ax.set(
        xscale="log",
        xlabel="ddtree budget (tree nodes)",
        ylabel="ms per round",
        title="Round time, Qwen3-8B shape (random weights)\n" + _subtitle(data, "rounds"),
    )
    return _save(plt, fig, ax, path, budgets, fontsize=7, ncol=2)


def chart_serve(data: dict, path: Path) -> bool:
    if "serve" not in data:
        return False
    plt, fig, ax = _figure()
    for method, levels in data["serve"].items():
        ax.plot(
            [r["concurrency"] for r in levels],
            [r["output_tokens_per_s"] for r in levels],
            marker="o",
            color=METHOD_COLOURS[method],
            label=method,
        )
    clients = sorted({r["concurrency"] for levels in data["serve"].values() for r in levels})
    ax.set_ylim(bottom=0)
    ax.set(
        xscale="log",
        xlabel="concurrent clients",
        ylabel="output tokens/s",
        title="ddtree serve, SmolLM2-135M-Instruct\n" + _subtitle(data, "serve"),
    )
    return _save(plt, fig, ax, path, clients)


def chart_forward(data: dict, path: Path) -> bool:
    micro = data.get("micro", {}).get("micro")
    if not micro or "hbm_bound_ms" not in micro:
        return False
    plt, fig, ax = _figure()
    for variant, ms in micro["forward_ms"].items():
        widths = sorted(int(t) for t in ms)
        ax.plot(widths, [ms[str(t)] if str(t) in ms else ms[t] for t in widths], marker="o", label=f"{variant} kernels")
    ax.axhline(micro["hbm_bound_ms"], linestyle="--", color="black", label="HBM bound (weights once)")
    ax.set(
        xscale="log",
        xlabel="tokens in the forward (batch 1, 1024 cached)",
        ylabel="ms",
        title="One target forward, Qwen3-8B shape\n" + _subtitle(data, "micro"),
    )
    ax.set_ylim(bottom=0)
    return _save(plt, fig, ax, path, widths, loc="lower right")


CHARTS = {
    "smollm2-tokens-per-second.png": chart_tokens_by_batch,
    "rounds-by-budget.png": chart_rounds_by_budget,
    "serve-tokens-per-second.png": chart_serve,
    "forward-by-width.png": chart_forward,
}


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _span(values: list[float], digits: int) -> str:
    """min–max of some runs' values (one value as itself); "—" for none."""
    if not values:
        return "—"
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}–{hi}"


PHASES = ("draft", "tree", "verify", "walk", "commit")


def config_name(method: str, budget: int, policy: str = "") -> str:
    """A round configuration as the tables name it: `ddtree` B=8 (`1:32,16:8`)."""
    name = f"`ddtree` B={budget}" if method == "ddtree" else f"`{method}`"
    return name + (f" (`{policy}`)" if policy else "")


def ab_table(runs: dict[str, list[dict]]) -> str:
    """The `ab` part: per configuration, the old runs' span → the new runs' span of the graph replay (ms),
    of the replay against the same run's `ar` replay at that batch size, and of each phase's kernel ms.
    A --policy row is a configuration of its own, after the fixed budgets."""
    rows = {
        run: {
            (r["method"], r["budget"], r["batch"], r.get("policy", "")): r
            for r in rs
            if "replay_ms" in r.get("graph_phases", {})
        }
        for run, rs in runs.items()
    }
    configs = sorted(
        {key for rs in rows.values() for key in rs},
        key=lambda k: (k[2], METHODS.index(k[0]), k[3], k[1] or 0),
    )

    def values(side: str, key: tuple, measure: str) -> list[float]:
        out = []
        for run, rs in rows.items():
            r, ar = rs.get(key), rs.get(("ar", 0, key[2], ""))
            if run.split("-")[0] != side or r is None:
                continue
            g = r["graph_phases"]
            if measure == "replay":
                out.append(g["replay_ms"])
            elif measure == "vs ar" and ar is not None:
                out.append(g["replay_ms"] / ar["graph_phases"]["replay_ms"])
            elif measure in g["phases"]:
                out.append(g["phases"][measure]["kernel_ms"])
        return out

    table = []
    for key in configs:
        method, budget, batch, policy = key
        cells = []
        for measure in ("replay", "vs ar", *PHASES):
            digits = 3 if measure in PHASES else 2
            cells.append(" → ".join(_span(values(side, key, measure), digits) for side in ("old", "new")))
        table.append([config_name(method, budget, policy), batch, *cells])
    header = ["method", "batch", "replay ms", "× `ar`", *(f"{p} kernel ms" for p in PHASES)]
    return "old → new, the span of each side's runs:\n\n" + _table(header, table)


def ab_kernels(runs: dict[str, list[dict]], top: int = 3, least_ms: float = 0.005) -> str:
    """The `ab` part kernel by kernel: per configuration and phase, the `top` kernels whose mean time per
    round moved most between the old and the new runs (by `least_ms` or more), each side's span of runs
    ("—": the kernel did not run on that side, as when cuBLAS picks another GEMM)."""
    rows: dict[tuple, dict[str, list[dict[str, float]]]] = {}
    for run, rs in runs.items():
        side = run.split("-")[0]
        for r in rs:
            if "replay_ms" not in r.get("graph_phases", {}):
                continue
            key = (r["method"], r["budget"], r["batch"], r.get("policy", ""))
            for phase, ph in r["graph_phases"]["phases"].items():
                kernels = {entry[0]: entry[1] for entry in ph["heaviest"]}  # [name, ms(, launches)]
                rows.setdefault((*key, phase), {"old": [], "new": []})[side].append(kernels)
    table = []
    for key in sorted(rows, key=lambda k: (k[2], METHODS.index(k[0]), k[3], k[1] or 0, PHASES.index(k[4]))):
        method, budget, batch, policy, phase = key
        sides = rows[key]
        if not sides["old"] or not sides["new"]:
            continue
        names = {name for side in sides.values() for kernels in side for name in kernels}
        change = {
            name: sum(k.get(name, 0.0) for k in sides["new"]) / len(sides["new"])
            - sum(k.get(name, 0.0) for k in sides["old"]) / len(sides["old"])
            for name in names
        }
        for name in sorted((n for n in names if abs(change[n]) >= least_ms), key=lambda n: -abs(change[n]))[:top]:
            spans = [_span([k[name] for k in sides[side] if name in k], 3) for side in ("old", "new")]
            table.append([batch, config_name(method, budget, policy), phase, f"`{name[:60]}`", *spans])
    header = ["batch", "method", "phase", "kernel", "old ms", "new ms"]
    return f"the kernels that moved most (up to {top} a phase, by {least_ms} ms or more):\n\n" + _table(header, table)


def markdown(data: dict) -> str:
    """The tables of docs/benchmarks.md for this data."""
    out = []
    micro = data.get("micro", {}).get("micro")
    if micro:
        for variant, ms in micro["forward_ms"].items():
            out.append(
                f"Forward ms ({variant} kernels), bound {micro.get('hbm_bound_ms')} ms at "
                f"{micro.get('copy_bandwidth_GBps')} GB/s:"
            )
            out.append(_table(["tokens", *ms], [["ms", *ms.values()]]))
            out.append(
                f"decode / HBM bound {micro['decode_over_hbm_bound'].get(variant)}, "
                f"verify 33 / decode {micro['verify33_over_decode'].get(variant)}"
            )
    capture = data.get("micro", {}).get("capture_all")
    if capture:
        for variant, c in capture.items():
            out.append(
                f"capture ({variant}): {c['graphs']} graphs in {c['capture_seconds']} s, "
                f"peak {c['peak_memory_GiB']} GiB"
            )
    for part in ("rounds", "smollm2"):
        if part not in data:
            continue
        rows = timed_rows(data[part])
        batches = sorted({r["batch"] for r in rows})
        configs = sorted(
            {(r["method"], r["budget"]) for r in rows},
            key=lambda mb: (METHODS.index(mb[0]), mb[1] or 0),
        )
        by = {(r["method"], r["budget"], r["batch"]): r for r in rows}
        table = []
        for method, budget in configs:
            name = config_name(method, budget)
            cells = []
            for b in batches:
                r = by.get((method, budget, b))
                if r is None:
                    cells.append("not measured")
                elif part == "rounds":
                    cells.append(f"{r['ms_per_round']}")
                else:
                    cells.append(f"{r['tokens_per_second']} ({r['acceptance_length']})")
            table.append([name, *cells])
        unit = "ms per round" if part == "rounds" else "tokens/s (acceptance length)"
        out.append(f"{part}: {unit}")
        out.append(_table(["method", *(f"batch {b}" for b in batches)], table))
        syncs = {r.get("host_syncs_per_round") for r in rows}
        fallbacks = {r.get("eager_fallbacks") for r in rows}
        out.append(f"host syncs per round: {sorted(syncs, key=str)}; eager fallbacks: {sorted(fallbacks, key=str)}")
        rec = data[part].get("recommended_budget")
        if rec:
            out.append(f"recommended: `{rec['flag']}`; per batch: {json.dumps(rec['per_batch'])}")
    if "serve" in data:
        table = []
        for method, levels in data["serve"].items():
            for r in levels:
                table.append(
                    [
                        f"`{method}`",
                        r["concurrency"],
                        r["output_tokens_per_s"],
                        r["acceptance_length"],
                        r["ttft_p50_s"],
                        r["ttft_p99_s"],
                        r["tpot_mean_ms"],
                        r["errors"],
                    ]
                )
        out.append(
            _table(
                ["method", "clients", "output tokens/s", "acceptance", "TTFT p50 s", "TTFT p99 s", "TPOT ms", "errors"],
                table,
            )
        )
    if "budget_auto" in data:
        clients = sorted({r["concurrency"] for levels in data["budget_auto"].values() for r in levels})
        table = []
        for label, levels in data["budget_auto"].items():
            by_clients = {r["concurrency"]: r for r in levels}
            table.append(
                [f"`{label}`"]
                + [
                    f"{round(by_clients[c]['output_tokens_per_s'])} ({by_clients[c]['acceptance_length']:.2f})"
                    if c in by_clients
                    else ""
                    for c in clients
                ]
            )
        out.append("budget auto against fixed budgets: output tokens/s (acceptance length):")
        out.append(_table(["budget", *(f"{c} client{'s' * (c > 1)}" for c in clients)], table))
    if "first_pass" in data:
        table = []
        for method in ("ar", "ddtree"):
            for commit, passes in data["first_pass"].items():
                if (method, "first") not in passes or (method, "second") not in passes:
                    continue
                first, second = passes[(method, "first")], passes[(method, "second")]
                ratio = round(first["output_tokens_per_s"] / second["output_tokens_per_s"], 2)
                for which, r in (("first", first), ("second", second)):
                    table.append(
                        [
                            f"`{method}`",
                            f"`{commit}`",
                            which,
                            r["output_tokens_per_s"],
                            ratio if which == "first" else "",
                            f"{round(1e3 * r['ttft_p50_s'])} / {round(1e3 * r['ttft_p99_s'])}",
                        ]
                    )
        out.append("first pass over new prompt lengths against the second:")
        out.append(
            _table(["method", "commit", "pass", "output tokens/s", "first / second", "TTFT p50 / p99 (ms)"], table)
        )
    if "ab" in data:
        out.append(ab_table(data["ab"]))
        out.append(ab_kernels(data["ab"]))
    return "\n\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="output folder of benchmarks/gpu.sh")
    ap.add_argument("--charts", type=Path, help="folder for the PNG charts (none drawn without it)")
    ap.add_argument("--markdown", action="store_true", help="print the tables")
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        print(f"report: {args.results} is not a folder", file=sys.stderr)
        return 2
    data = load(args.results)
    if not any(k in data for k in ("micro", "rounds", "smollm2", "serve", "budget_auto", "first_pass", "ab")):
        print(f"report: no benchmark output in {args.results}", file=sys.stderr)
        return 2
    if args.charts:
        args.charts.mkdir(parents=True, exist_ok=True)
        for name, draw in CHARTS.items():
            if draw(data, args.charts / name):
                print(f"wrote {args.charts / name}", file=sys.stderr)
    if args.markdown:
        print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
