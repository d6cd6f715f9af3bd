"""Tensor parallelism on CPU (gloo, separate processes): the split target emits exactly the tokens of
the unsplit one, and a split that does not divide the model is refused. Serving: rank 0's Leader and the
followers' replay stay in step (sampling included), and `ddtree serve --tensor-parallel 3` answers like
the unsplit engine and leaves no process behind."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist

from ddtree.runtime.constrained import constrain
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.parallel import Leader, check_divisible, command_group, follow, launch, shard, split
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from test_constrained import ResidueConstraint
from tiny_models import random_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
METHODS = [("ar", None), ("dflash", None), ("ddtree", 8)]


def generate_all(target, drafter, prompts, new_tokens):
    out = {}
    for method, budget in METHODS:
        eng = Engine(target, drafter, method, budget, max_batch_size=len(prompts), max_seq_len=96)
        out[method] = [r.token_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens))]
    return out


def tiny_pair():
    target = random_target(vocab=64, hidden=64, layers=3, heads=4, kv_heads=2, seed=3)
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=2, block_size=8), seed=1)
    return target, drafter


def tiny_rank(rank, world, replicate_drafter):
    torch.set_num_threads(1)
    target, drafter = tiny_pair()
    how = split(target, drafter, rank, world, replicate_drafter)
    rows = drafter.layers[0].self_attn.q_proj.weight.shape[0]  # this rank's heads only when split
    assert (how, rows) == (("replicated", 64) if replicate_drafter else ("split", 64 // world))
    return generate_all(target, drafter, PROMPTS, 16)


@pytest.mark.parametrize("replicate_drafter", [False, True], ids=["drafter-split", "drafter-replicated"])
def test_tp2_equals_tp1_on_a_tiny_model(replicate_drafter):
    expected = generate_all(*tiny_pair(), PROMPTS, 16)
    assert launch(2, tiny_rank, replicate_drafter) == expected


def large_result_rank(rank, world):
    return list(range(200_000)) if rank == 0 else None


def test_launch_returns_a_result_larger_than_a_pipe_holds():
    """Rank 0's result (about 1 MB pickled) is read while the ranks run: a reader that waits for them first
    leaves rank 0 blocked in put() for ever."""
    assert launch(2, large_result_rank) == list(range(200_000))


@pytest.mark.slow  # four CLI runs, two of them two processes: about 25 s on 2 cores
def test_generate_on_a_random_model_is_the_same_split_or_not():
    """`ddtree generate --model random:tiny --drafter random:2` (cost runs need no checkpoint): TP 2, with
    the drafter split or replicated, emits the unsplit tokens; --replicate-drafter alone is refused."""

    def run(*flags):
        cmd = [
            sys.executable,
            "-m",
            "ddtree",
            "generate",
            "--model",
            "random:tiny",
            "--drafter",
            "random:2",
            "--prompt",
            "hello world",
            "--max-new-tokens",
            "12",
            "--json",
            "--device",
            "cpu",
            *flags,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    one = run()
    assert one.returncode == 0, one.stderr
    tokens = json.loads(one.stdout.splitlines()[-1])["token_ids"]
    assert len(tokens) == 12
    for flags in (["--tensor-parallel", "2"], ["--tensor-parallel", "2", "--replicate-drafter"]):
        out = run(*flags)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.splitlines()[-1])["token_ids"] == tokens, flags
    bad = run("--replicate-drafter")
    assert bad.returncode == 2 and "--replicate-drafter needs --tensor-parallel > 1" in bad.stderr


@torch.inference_mode()
def nccl_graph_rank(rank, world):
    """Rank `rank` of a 2-GPU NCCL group: the split target's logits against the full model's, and
    ar / dflash / ddtree rounds replayed from CUDA graphs (all-reduces and all-gathers inside)
    against the full model run eagerly on the same GPU. A rank still running after 240 s (in here or
    in the group teardown that follows) prints its stack and exits, which fails the test."""
    import faulthandler

    from ddtree.speculative.drafter import random_drafter

    faulthandler.dump_traceback_later(240, exit=True)  # never cancelled: it ends with the process

    target = random_target(vocab=256, hidden=256, layers=4, heads=8, kv_heads=4, seed=5).to(f"cuda:{rank}")
    drafter = random_drafter(target, 2, block_size=8, seed=2)
    ids = torch.tensor([PROMPTS[2] * 4], device=f"cuda:{rank}")
    j = torch.arange(ids.shape[1], device=ids.device)
    mask = (j[None, :] <= j[:, None])[None, None]

    def logits(model):
        model.setup_caches(1, ids.shape[1])
        return model(ids, j[None], j[None], mask)[0]

    full_logits = logits(target)
    expected = generate_all(target, drafter, PROMPTS, 24)
    assert split(target, drafter, rank, world) == "split"
    diff = (logits(target) - full_logits).abs().max() / full_logits.abs().max()
    out = {"relative_logit_diff": diff.item()}
    for method, budget in METHODS:
        eng = Engine(target, drafter, method, budget, max_batch_size=4, max_seq_len=96)
        eng.capture_graphs([1, 2, 4])
        got = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_new_tokens=24))]
        out[method] = got == expected[method]
        out[f"{method}_graphs"] = len(eng.graphs.graphs)  # no fallback: a round without one raises
    return out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_nccl_tensor_parallel_in_cuda_graphs_equals_one_gpu():
    out = launch(2, nccl_graph_rank, device_type="cuda")
    assert out["relative_logit_diff"] < 1e-4, out
    for method, _ in METHODS:
        assert out[method], out
        assert out[f"{method}_graphs"] > 0, out


def smollm2_rank(rank, world, folder, prompts):
    from ddtree.models.llama import Transformer

    torch.set_num_threads(1)
    target = Transformer.from_pretrained(folder, dtype=torch.float32)
    drafter = init_drafter(DrafterConfig.for_target(target.config), seed=0)
    shard(target, rank, world)
    return generate_all(target, drafter, prompts, 12)


@pytest.mark.slow
def test_tp3_equals_tp1_on_smollm2(smollm2):
    """SmolLM2 has 9 attention heads and 3 KV heads: 3 is the split that divides it (2 is refused)."""
    model, tok, folder = smollm2
    prompts = [tok.encode("The capital of France is"), tok.encode("def add(a, b):\n")]
    drafter = init_drafter(DrafterConfig.for_target(model.config), seed=0)
    expected = generate_all(model, drafter, prompts, 12)
    assert launch(3, smollm2_rank, str(folder), prompts) == expected


@pytest.mark.slow
def test_a_split_that_does_not_divide_the_model_is_refused(smollm2):
    model = smollm2[0]
    with pytest.raises(
        ValueError,
        match=r"tensor parallel 2 does not divide the model: 9 attention heads, "
        r"3 KV heads \(each must be a multiple of 2\)",
    ):
        check_divisible(model.config, 2)
    with pytest.raises(ValueError, match="5 attention heads"):
        shard(random_target(hidden=80, heads=5, kv_heads=5), 0, 2)


# ---- serving: Leader and follow -----------------------------------------------------------------


def drive(engine):
    """A continuous-batching session: requests join and leave between rounds, one is refused, one samples."""
    greedy = SamplingParams(max_new_tokens=64)
    out = {"first": [engine.add(0, PROMPTS[0], greedy)], "steps": []}
    out["steps"].append(engine.step(1))
    with pytest.raises(ValueError, match="vocabulary"):  # refused on every rank, before any collective
        engine.add(1, [1, 2, 999], greedy)
    engine.release(1)
    out["first"].append(engine.add(1, PROMPTS[1], SamplingParams(max_new_tokens=64, temperature=1.0, seed=7)))
    out["first"].append(engine.add(2, PROMPTS[2], greedy))
    out["grow"] = [engine.grow(row) for row in range(3)]  # the pages a round takes, on every rank alike
    for _ in range(3):
        out["steps"].append(engine.step(3))
    # constrained decoding: replacements (a sampled one in row 1) are made on every rank alike
    emitted = engine.step(3)
    out["steps"].append([list(tokens) for tokens in emitted])
    constrain(engine, emitted, {1: ResidueConstraint(64), 2: ResidueConstraint(64)})
    out["constrained"] = emitted
    engine.release(0)  # row 0 leaves, rows 1 and 2 go on
    for _ in range(2):
        out["steps"].append(engine.step(3))
    return out


class Recorder:
    """A follower's engine that keeps what each replayed call returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        fn = getattr(self.engine, name)

        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            self.calls.append((name, result))
            return result

        return call


def tiny_engine():
    torch.set_num_threads(1)
    target = random_target(vocab=64, hidden=64, layers=3, heads=4, kv_heads=2, seed=3)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=8), seed=1)
    return target, drafter


def leader_rank(rank, world):
    target, drafter = tiny_engine()
    shard(target, rank, world)
    engine = Engine(target, drafter, "ddtree", 8, max_batch_size=3, max_seq_len=96, logprobs=True)
    group = command_group()
    if rank > 0:
        recorder = Recorder(engine)
        follow(recorder, group)
        dist.gather_object(recorder.calls, None, dst=0)
        return None
    leader = Leader(engine, group)
    out = drive(leader)
    leader.stop()
    calls = [None] * world
    dist.gather_object(None, calls, dst=0)
    return out, calls[1:]


def test_followers_replay_rank0_calls_in_step_and_greedy_equals_tp1():
    target, drafter = tiny_engine()
    expected = drive(Engine(target, drafter, "ddtree", 8, max_batch_size=3, max_seq_len=96, logprobs=True))
    out, (follower,) = launch(2, leader_rank)
    steps = [result for name, result in follower if name == "step"]
    firsts = [result for name, result in follower if name == "add"]
    assert [result for name, result in follower if name == "grow"] == out["grow"] == [True] * 3
    assert steps == out["steps"] and firsts == out["first"], "a follower sampled or walked differently"
    (replaced,) = [result for name, result in follower if name == "override"]
    assert 1 in replaced, "the sampled row's replacement is drawn on every rank alike"
    assert all(out["constrained"][row][-1] == token for row, token in replaced.items())
    assert [name for name, _ in follower] == [
        "add",
        "step",
        "release",
        "add",
        "add",
        "grow",
        "grow",
        "grow",
        "step",
        "step",
        "step",
        "step",
        "override",
        "release",
        "step",
        "step",
    ]  # the refused add raised on both
    greedy = [[s[0] for s in out["steps"][1:5]], [s[2] for s in out["steps"][1:]]]
    assert greedy == [[s[0] for s in expected["steps"][1:5]], [s[2] for s in expected["steps"][1:]]]
    assert out["first"][::2] == expected["first"][::2]


@pytest.mark.slow
def test_serve_refuses_a_split_that_does_not_divide_the_model(smollm2, capsys, monkeypatch):
    from ddtree.cli import main

    base = ["serve", "--model", "smollm2-135m-instruct", "--method", "ar", "--device", "cpu"]
    assert main([*base, "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        (
            "ddtree: error: tensor parallel 2 does not divide the model: 9 attention heads, 3 KV heads "
            "(each must be a multiple of 2)"
        )
    ]
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main([*base, "--tensor-parallel", "2"]) == 2
    assert "differs from torchrun's WORLD_SIZE 3" in capsys.readouterr().err


# ---- serving: `ddtree serve --tensor-parallel 3` with SmolLM2 ----------------------------------------


SERVE_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SERVE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "Three reasons to learn Python:",
]


def start_server(*args, log):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree",
            "serve",
            "--model",
            "smollm2-135m-instruct",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=SERVE_ENV,
    )
    return proc


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphaned zombie waits for an init that may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout=60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if running(p)]


def post(url, body, timeout=600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if not body.get("stream"):
            return json.loads(r.read())["choices"][0]["text"]
        text = ""
        for line in r:
            if line.startswith(b"data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return text


def reference_texts(smollm2, prompts, max_tokens):
    """The same requests through the scheduler on the unsplit engine, in this process."""
    from ddtree.runtime.build import load_drafter_ref, stop_ids
    from ddtree.serving.metrics import ServerMetrics
    from ddtree.serving.scheduler import Request, Scheduler

    model, tok, _ = smollm2
    drafter = load_drafter_ref("smollm2-135m-instruct-dflash", model, "cpu", torch.float32)
    engine = Engine(model, drafter, "ddtree", None, max_batch_size=4, max_seq_len=256)
    sched = Scheduler(engine, tok, ServerMetrics("reference"), 8)
    sched.start()
    events = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    for i, p in enumerate(prompts):

        def sink(ev, i=i):
            events[i].append(ev)
            if ev.finish_reason or ev.error:
                done[i].set()

        params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stop_ids(tok, model))
        sched.submit(Request(tok.encode(p), params, [], sink))
    assert all(d.wait(300) for d in done)
    sched.stop()
    return {p: "".join(e.text for e in evs) for p, evs in zip(prompts, events)}


@pytest.mark.slow
def test_serve_tp3_answers_like_tp1_and_sigterm_ends_every_rank(smollm2, tmp_path):
    from ddtree.serving.metrics import read_samples, total

    max_tokens = 24
    expected = reference_texts(smollm2, SERVE_PROMPTS, max_tokens)
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = start_server(
            "--tensor-parallel", "3", "--max-batch-size", "4", "--max-seq-len", "256", "--batch-buckets", "1", log=log
        )

    def output():
        return log_path.read_text()[-6000:]

    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, output()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{m[1]}"
        while True:  # /ready turns 200 once every rank loaded and the smoke test passed on all of them
            assert proc.poll() is None and time.monotonic() < deadline, output()
            try:
                with urllib.request.urlopen(url + "/ready", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        followers = children(proc.pid)
        assert len(followers) >= 2, followers  # ranks 1 and 2 (and multiprocessing's resource tracker)
        assert output().count("listening on") == 1, "only rank 0 serves HTTP"

        def body(p, **kw):
            return {"prompt": p, "max_tokens": max_tokens, "temperature": 0, **kw}

        assert post(url + "/v1/completions", body(SERVE_PROMPTS[0])) == expected[SERVE_PROMPTS[0]]
        assert post(url + "/v1/completions", body(SERVE_PROMPTS[1], stream=True)) == expected[SERVE_PROMPTS[1]]

        def scrape():
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                return read_samples(r.read().decode())

        before = scrape()
        got = {}

        def client(i, p):
            got[p] = post(url + "/v1/completions", body(p, stream=bool(i % 2)))

        threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(SERVE_PROMPTS)]
        for t in threads:  # concurrent: several rows share rounds
            t.start()
        for t in threads:
            t.join(600)
        assert got == expected
        after = scrape()
        drafts = total(after, "ddtree_spec_decode_num_drafts_total") - total(
            before, "ddtree_spec_decode_num_drafts_total"
        )
        rounds = total(after, "ddtree_engine_step_seconds_count") - total(before, "ddtree_engine_step_seconds_count")
        assert drafts > rounds > 0, "the concurrent requests must have shared rounds"
        assert total(after, "ddtree_requests_total", status="200") == 6
    finally:
        pids = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        left = wait_gone(pids, 30)
        for p in left:
            os.kill(p, signal.SIGKILL)
    assert code == 0, output()
    assert not left, f"processes left behind after SIGTERM: {left}"


@pytest.mark.slow
def test_followers_die_with_a_killed_rank0(tmp_path):
    with open(tmp_path / "server.log", "w") as log:
        proc = start_server(
            "--method", "ar", "--tensor-parallel", "3", "--max-batch-size", "1", "--max-seq-len", "64", log=log
        )
    deadline = time.monotonic() + 120
    while len(followers := [p for p in children(proc.pid) if running(p)]) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # let them get into torch
    proc.kill()
    proc.wait()
    left = wait_gone(followers, 30)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert len(followers) == 3 and not left, (followers, left, (tmp_path / "server.log").read_text()[-3000:])
