"""The per-phase profile of a round under CUDA graphs (runtime/round_profile.py): the trace split runs
everywhere on a hand-made trace; the profile itself runs on a CUDA device."""

import pytest
import torch

from ddtree.runtime import round_profile
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.round_profile import MARKER, phase_floors, round_phases, split_phases
from ddtree.speculative.drafter import DrafterConfig, init_drafter
from tiny_models import random_target

gpu = pytest.mark.gpu  # CUDA graphs; conftest.py skips it without a CUDA device


def marked_replay(t0: float, kernels: dict[str, list[tuple[str, float]]]) -> list[tuple[str, float, float]]:
    """One replay's device events from t0: a 1 µs marker, then each phase's kernels (name, µs) with 2 µs
    gaps, and the marker that closes the phase."""
    events, t = [(f"void {MARKER}(long)", t0, t0 + 1)], t0 + 1
    for phase_kernels in kernels.values():
        for name, us in phase_kernels:
            events.append((name, t + 2, t + 2 + us))
            t += 2 + us
        events.append((f"void {MARKER}(long)", t + 2, t + 3))
        t += 3
    return events


def test_split_phases_names_each_phase_after_the_marker_that_closes_it():
    kernels = {"draft": [("gemm", 30.0), ("norm", 4.0)], "verify": [("gemm", 100.0)], "commit": []}
    events = marked_replay(0, kernels) + marked_replay(1000, kernels) + [("Memcpy DtoD", 500, 501)]
    out = split_phases(list(reversed(events)), ["start", "draft", "verify", "commit"], replays=2)
    draft, verify, commit = (out["phases"][p] for p in ("draft", "verify", "commit"))
    assert draft["kernels"] == 2 and draft["kernel_ms"] == pytest.approx(0.034)
    assert draft["gap_ms"] == pytest.approx(0.006)
    assert draft["heaviest"] == [["gemm", 0.03, 1.0], ["norm", 0.004, 1.0]]  # every kernel, heaviest first
    assert verify["kernels"] == 1 and verify["wall_ms"] == pytest.approx(0.104)
    assert commit == {"kernels": 0, "kernel_ms": 0.0, "gap_ms": 0.002, "wall_ms": 0.002, "heaviest": []}
    assert out["marked_round_ms"] == pytest.approx(0.040 + 0.001 + 0.104 + 0.001 + 0.002)  # the inner markers count


def test_split_phases_counts_an_early_launched_kernel_from_the_end_of_the_one_before_it():
    """Under programmatic dependent launch a kernel starts while the one before it runs and waits for it:
    the overlap is counted once, so kernel time plus gaps stays the phase's span."""
    marker = f"void {MARKER}(long)"
    # gemm 2..32; norm launched at 20, waits, ends at 36; silu launched at 30, inside norm's span, ends at 34
    events = [(marker, 0, 1), ("gemm", 2, 32), ("norm", 20, 36), ("silu", 30, 34), (marker, 37, 38)]
    draft = split_phases(events, ["start", "draft"], replays=1)["phases"]["draft"]
    assert draft["kernel_ms"] == pytest.approx(0.034) and draft["gap_ms"] == pytest.approx(0.002)
    assert draft["heaviest"] == [["gemm", 0.03, 1.0], ["norm", 0.004, 1.0], ["silu", 0.0, 1.0]]


def test_split_phases_refuses_a_trace_without_the_graphs_kernels():
    with pytest.raises(RuntimeError, match="profiler did not see the graph's kernels"):
        split_phases([("cudaGraphLaunch", 0, 5)], ["start", "verify"], replays=3)


def make(device, method, budget, batch=4):
    target = random_target().to(device)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=8), seed=1).to(device)
    return Engine(target, drafter, method, budget, max_batch_size=batch, max_seq_len=96)


def test_floors_count_the_weights_each_phase_reads():
    engine = make("cpu", "ddtree", 8)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    floors = phase_floors(engine, 1, context=40, bandwidth=1e12, flops=1e15)
    assert set(floors) == {"draft", "tree", "verify", "walk", "commit"}
    lm_head = engine.target.lm_head.weight
    drafter_bytes = sum(p.numel() * p.element_size() for p in engine.drafter.state_dict().values())
    assert floors["draft"]["bytes"] > drafter_bytes + lm_head.numel() * lm_head.element_size()
    assert floors["verify"]["bytes"] > lm_head.numel() * lm_head.element_size()
    assert all(f["floor_ms"] >= f["bytes"] / 1e12 * 1000 - 1e-4 for f in floors.values())
    assert set(phase_floors(make("cpu", "ar", None), 1, 40, 1e12, 1e15)) == {"verify", "walk", "commit"}


def test_floors_of_an_mla_target_read_its_latent_cache():
    from test_deepseek_v3 import tiny_mla

    target = tiny_mla()
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=8), seed=1)
    engine = Engine(target, drafter, "ddtree", 8, max_batch_size=2, max_seq_len=64)
    floors = phase_floors(engine, 2, context=20, bandwidth=1e12, flops=1e15)
    latent = target.config.latent_dim * target.lm_head.weight.element_size() * target.config.num_hidden_layers
    assert floors["commit"]["bytes"] >= 2 * 2 * 9 * latent and floors["verify"]["flops"] > 0


def test_floors_of_a_mixture_of_experts_count_the_experts_its_tokens_reach(monkeypatch):
    """A decode step of tiny_mla (8 routed experts, 2 a token) reads 2 of each MoE block's 8 experts and
    multiplies with them only; 18 rows (2 sequences, 9-token trees) reach 8 * (1 - (6/8)^18) on average."""
    from ddtree.models.moe import SparseMoE
    from ddtree.runtime.round_profile import stored_weights, unreached_experts
    from test_deepseek_v3 import tiny_mla

    target = tiny_mla()
    blocks = [m for m in target.modules() if isinstance(m, SparseMoE)]
    experts = [stored_weights(b.experts) for b in blocks]
    expert_bytes, expert_elements = sum(e[0] for e in experts), sum(e[1] for e in experts)
    assert blocks and all(len(b.experts) == 8 and b.gate.top_k == 2 for b in blocks)
    assert unreached_experts(target, 1) == pytest.approx((expert_bytes * 6 / 8, expert_elements * 6 / 8))
    assert unreached_experts(target, 18)[0] == pytest.approx(expert_bytes * (6 / 8) ** 18)
    assert unreached_experts(target, 18)[1] == pytest.approx(expert_elements * 6 / 8)

    # the verify of a decode step against the same floor with every expert read and multiplied
    engine = Engine(target, None, "ar", None, max_batch_size=2, max_seq_len=64)
    step = phase_floors(engine, 1, 20, 1e12, 1e15)["verify"]
    monkeypatch.setattr(round_profile, "unreached_experts", lambda model, tokens: (0.0, 0.0))
    every_expert = phase_floors(engine, 1, 20, 1e12, 1e15)["verify"]
    assert every_expert["bytes"] - step["bytes"] == pytest.approx(expert_bytes * 6 / 8, abs=1)
    assert every_expert["flops"] - step["flops"] == pytest.approx(2 * expert_elements * 6 / 8, abs=2)


@gpu
@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 8)])
def test_profile_splits_a_graph_replay_into_its_phases(method, budget):
    engine = make("cuda", method, budget, batch=2)
    engine.capture_graphs([2], [128])
    sp = SamplingParams(max_new_tokens=64)
    for row, prompt in enumerate([[1, 2, 3, 4], [5, 6]]):
        engine.add(row, prompt, sp)
    engine.step(2)
    lengths = engine.lengths.clone()
    out = round_phases(engine, 2, bandwidth=3e12, flops=5e14, replays=4)
    expected = ["tree", "verify", "walk", "commit"] if method == "ar" else ["draft", "tree", "verify", "walk", "commit"]
    assert list(out["phases"]) == expected
    assert all(out["phases"][p]["kernels"] > 0 for p in ("verify", "commit"))
    walls = sum(p["wall_ms"] for p in out["phases"].values())
    assert walls <= out["marked_round_ms"] and out["replay_ms"] > 0
    assert torch.equal(engine.lengths, lengths), "replays rewind the rows"
    # the graphs step replays are unchanged by the profile: the rows go on as before
    assert all(len(t) >= 1 for t in engine.step(2))


def test_the_phase_table_names_each_phase_and_its_heaviest_kernel():
    from ddtree.runtime.bench import phase_markdown

    kernels = {"draft": [("gemm", 30.0), ("norm", 4.0), ("norm", 4.0)], "verify": [("gemm", 100.0)], "commit": []}
    split = split_phases(marked_replay(0, kernels), ["start", "draft", "verify", "commit"], replays=1)
    assert split["phases"]["draft"]["heaviest"] == [["gemm", 0.03, 1.0], ["norm", 0.008, 2.0]]
    for phase in split["phases"].values():
        phase["floor_ms"] = 0.01
    row = {"method": "ddtree", "budget": 8, "batch": 1, "host_timed_minus_replay_ms": 0.1}
    row["graph_phases"] = {**split, "replay_ms": 0.15, "floor_ms": 0.03}
    table = phase_markdown([row])
    assert "| ddtree | 8 | 1 | draft | 3.0 | 0.038 | 0.008 | 0.01 | `gemm` 0.03 |" in table
    assert "| ddtree | 8 | 1 | commit | 0.0 | 0.0 | 0.002 | 0.01 | `` 0 |" in table
    assert "| ddtree | 8 | 1 | **round** | | 0.15 (replay) | 0.1 (host timed − replay) | 0.03 | |" in table
