"""Command line: clear one-line errors with exit code 2; init-drafter; generate --json."""

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "ddtree", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=600,
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["generate", "--model", "/no/such/model", "--method", "ar", "--prompt", "hi"], "model not found"),
        (
            ["generate", "--model", "smollm2-135m-instruct", "--method", "beam", "--prompt", "hi"],
            "invalid choice: 'beam'",
        ),
        (
            ["generate", "--model", "x", "--method", "ddtree", "--budget", "-3", "--drafter", "d", "--prompt", "hi"],
            "--budget must be >= 0",
        ),
        (["generate", "--model", "x", "--method", "dflash", "--prompt", "hi"], "needs --drafter"),
        (
            ["generate", "--model", "x", "--method", "dflash", "--budget", "1:8", "--drafter", "d", "--prompt", "hi"],
            "a budget per batch size needs --method ddtree",
        ),
        (["generate", "--model", "x", "--budget", "1:eight", "--prompt", "hi"], "BATCH:BUDGET pairs like 1:32,16:8"),
        (
            ["generate", "--model", "x", "--budget", "0:8", "--prompt", "hi"],
            "batch sizes must be >= 1 and budgets >= 0",
        ),
        (["generate", "--model", "x", "--prompt", "hi", "--max-new-tokens", "0", "--method", "ar"], "--max-new-tokens"),
        (["generate", "--prompt", "hi"], "required: --model"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_json_and_drafter_round_trip(tmp_path, smollm2):
    out = tmp_path / "drafter"
    r = run_cli("init-drafter", "--target", "smollm2-135m-instruct", "--out", str(out), "--layers", "1", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [15]
    results = {}
    for method in ("ar", "ddtree"):
        r = run_cli(
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--drafter",
            str(out),
            "--method",
            method,
            "--budget",
            "16",
            "--max-new-tokens",
            "12",
            "--prompt",
            "The capital of France is",
            "--json",
        )
        assert r.returncode == 0, r.stderr
        results[method] = json.loads(r.stdout.strip().splitlines()[-1])
    assert results["ddtree"]["token_ids"] == results["ar"]["token_ids"]
    assert results["ddtree"]["text"] == results["ar"]["text"] and "Paris" in results["ar"]["text"]
    assert results["ar"]["acceptance_length"] == 1.0
    assert set(results["ddtree"]) >= {"text", "token_ids", "acceptance_length", "tokens_per_second", "steps"}
    r = run_cli(
        "generate",
        "--model",
        "smollm2-135m-instruct",
        "--method",
        "ar",
        "--chat",
        "--max-new-tokens",
        "10",
        "--prompt",
        "What is 2+2? Answer briefly.",
    )
    assert r.returncode == 0 and "4" in r.stdout, r.stderr


@pytest.mark.slow
def test_init_drafter_writes_a_dflash2_drafter_that_runs_as_a_chain(tmp_path, smollm2):
    out = tmp_path / "drafter2"
    r = run_cli("init-drafter", "--target", "smollm2-135m-instruct", "--out", str(out), "--layout", "dflash2")
    assert r.returncode == 0 and "DFlash2DraftModel" in r.stdout, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 8
    tokens = {}
    for method in ("ar", "dflash"):
        args = ["--model", "smollm2-135m-instruct", "--drafter", str(out), "--method", method]
        r = run_cli("generate", *args, "--max-new-tokens", "12", "--prompt", "The capital of France is", "--json")
        assert r.returncode == 0, r.stderr
        tokens[method] = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    assert tokens["dflash"] == tokens["ar"]
    r = run_cli(
        "generate", "--model", "smollm2-135m-instruct", "--drafter", str(out), "--method", "ddtree", "--prompt", "Hi"
    )
    assert r.returncode == 2 and "DFlash2" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_smoke_passes_and_a_corrupted_input_fails_with_termination_log(tmp_path, smollm2):
    drafter = tmp_path / "drafter"
    assert run_cli("init-drafter", "--target", "smollm2-135m-instruct", "--out", str(drafter)).returncode == 0
    common = [
        "smoke",
        "--model",
        "smollm2-135m-instruct",
        "--drafter",
        str(drafter),
        "--method",
        "ddtree",
        "--budget",
        "8",
        "--batch-sizes",
        "1,2",
        "--max-new-tokens",
        "4",
        "--max-seq-len",
        "128",
        "--termination-log",
        str(tmp_path / "termination-log"),
    ]
    ok = run_cli(*common)
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["mode"] == "eager" and report["mismatches"] == []
    assert set(report) >= {"passed", "captured", "capture_seconds", "mismatches", "reason"}
    assert not (tmp_path / "termination-log").exists()
    bad = run_cli(*common, "--fault", "corrupt-graph-input")
    assert bad.returncode == 1
    report = json.loads(bad.stdout.strip().splitlines()[-1])
    assert not report["passed"] and report["mismatches"]
    assert (tmp_path / "termination-log").read_text().startswith("smoke test failed")


@pytest.mark.slow
def test_generate_tensor_parallel_matches_and_a_bad_split_is_refused(smollm2):
    out = {}
    for tp in ("1", "3"):
        r = run_cli(
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--method",
            "ddtree",
            "--budget",
            "8",
            "--max-new-tokens",
            "8",
            "--prompt",
            "The capital of France is",
            "--json",
            "--tensor-parallel",
            tp,
        )
        assert r.returncode == 0, r.stderr
        out[tp] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["3"]["token_ids"] == out["1"]["token_ids"] and out["3"]["tensor_parallel"] == 3
    r = run_cli(
        "generate", "--model", "smollm2-135m-instruct", "--method", "ar", "--prompt", "x", "--tensor-parallel", "2"
    )
    assert r.returncode == 2 and "tensor parallel 2 does not divide the model: 9 attention heads" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bench_on_cpu_uses_every_prompt_and_recommends_a_budget_per_batch(tmp_path):
    from ddtree.cli import parse_budget

    r = run_cli(
        "bench",
        "--model",
        "random:tiny",
        "--drafter",
        "random:1",
        "--device",
        "cpu",
        "--graphs",
        "off",
        "--methods",
        "ar,dflash,ddtree",
        "--budgets",
        "4,8",
        "--batch-sizes",
        "1,2",
        "--rounds",
        "2",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    rows = [x for x in records if "method" in x]
    assert len(rows) == 8 and all(x["prompts"] == 4 for x in rows), "batch 1 and 2 cycle through all 4 prompts"
    best = records[-1]["recommended_budget"]
    assert set(best["per_batch"]) == {"1", "2"} and best["flag"].startswith("--budget 1:")
    for batch, entry in best["per_batch"].items():
        ddtree = [x for x in rows if x["method"] == "ddtree" and x["batch"] == int(batch)]
        assert entry["tokens_per_second"] == max(x["tokens_per_second"] for x in ddtree)
        assert {"vs_dflash", "vs_ar"} <= set(entry)
    # the flag switches speculation off (budget 0) where plain decoding beat every budget
    slower = [b for b, e in best["per_batch"].items() if e["vs_ar"] < 1]
    assert parse_budget(best["flag"].split()[1]) == {
        int(b): 0 if b in slower else e["budget"] for b, e in best["per_batch"].items()
    }
    md = (tmp_path / "bench.md").read_text()
    assert best["flag"] in md
    # where plain decoding beat every budget (likely here: a random drafter accepts almost nothing), it is said
    assert [str(b) for b in best["ar_faster_at"]] == slower  # JSON keys are strings
    assert ("`ar` is faster than every measured `ddtree` budget" in md) == bool(slower)


def test_bench_runs_a_budget_per_batch_size_beside_the_fixed_budgets(tmp_path):
    r = run_cli(
        "bench",
        *("--model", "random:tiny", "--drafter", "random:1", "--device", "cpu", "--graphs", "off"),
        *("--methods", "ddtree", "--budgets", "4", "--policy", "1:6,2:2", "--batch-sizes", "1,2", "--rounds", "2"),
        *("--out", str(tmp_path)),
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    rows = {(x["batch"], x["budget"], x.get("policy")) for x in records if "method" in x}
    # each batch size runs the policy's budget for it
    assert rows == {(1, 4, None), (2, 4, None), (1, 6, "1:6,2:2"), (2, 2, "1:6,2:2")}
    best = records[-1]["recommended_budget"]
    assert all(e["budget"] == 4 for e in best["per_batch"].values()), "the recommendation is among the fixed budgets"
    assert "| ddtree | torch | 2 (`1:6,2:2`) | 2 | False |" in (tmp_path / "bench.md").read_text()


def test_bench_refuses_a_policy_that_is_not_one_and_a_policy_without_ddtree():
    bad = run_cli("bench", "--model", "random:tiny", "--device", "cpu", "--policy", "8")
    assert bad.returncode == 2 and "--policy takes BATCH:BUDGET pairs like 1:32,16:8, got '8'" in bad.stderr
    no_ddtree = run_cli(
        "bench", "--model", "random:tiny", "--device", "cpu", "--graphs", "off", "--methods", "ar", "--policy", "1:8"
    )
    assert no_ddtree.returncode == 2 and "--policy runs ddtree: add ddtree to --methods" in no_ddtree.stderr
    assert len(no_ddtree.stderr.strip().splitlines()) == 1


def test_python_m_ddtree_is_the_console_script():
    from ddtree.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    ok = subprocess.run([sys.executable, "-m", "ddtree", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("usage: ddtree ") and all(f"    {name} " in ok.stdout for name in commands), ok.stdout
    script = os.path.join(os.path.dirname(sys.executable), "ddtree")
    if os.path.exists(script):  # the installed console script prints the same
        assert subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120).stdout == ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ddtree", "generate", "--model", "x", "--prompt", "hi", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["ddtree: error: unrecognized arguments: --no-such-flag"], bad.stderr
