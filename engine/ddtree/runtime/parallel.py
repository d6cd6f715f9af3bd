"""Tensor parallelism of the target over N ranks (torch.distributed: gloo on CPU, NCCL on GPUs).

Megatron-style split: q/k/v and gate/up are column-parallel (each rank keeps its attention heads and
MLP columns), o_proj and down_proj row-parallel with one all-reduce each, the embedding and LM head
vocabulary-parallel (masked lookup + all-reduce, all-gather of the logits). The KV cache is sharded by
KV heads. The residual stream, and so every tapped hidden state, is the same on every rank, so the tree
build and walk run identically everywhere, with no extra communication. The drafter's layers are split
the same way (or, with replicate_drafter, run whole on every rank).

Serving (`ddtree serve --tensor-parallel N`): rank 0 runs the HTTP server and the scheduler on a `Leader`,
which broadcasts every engine call (begin / prefill / step / release / capture_graphs / smoke) to the other ranks
before making it locally; ranks 1..N-1 `follow`: they replay those calls, in the same order, on their
shard. Same calls in the same order means the same sampling generator state on every rank, so sampled
trees and walks also agree without communication.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..models.layers import Collectives, QuantizedSplitError, keep_rows, shard_dense_layers
from ..models.llama import Transformer
from ..models.memory import indivisible_split
from .fused import use_backend

log = logging.getLogger("ddtree.parallel")


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """Concatenate the ranks' x along the last dim (one collective into one buffer: graph-safe)."""
        gathered = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x.contiguous())
        parts = gathered.view(self.world, *x.shape)
        return parts.movedim(0, -2).reshape(*x.shape[:-1], self.world * x.shape[-1])


def check_divisible(cfg, world: int, what: str = "the model", whole_experts: bool = True) -> None:
    """Refuse a split that does not divide the model (or drafter) evenly, naming every offending size
    (the config's split_sizes(): what its family splits over the ranks)."""
    sizes = cfg.split_sizes() if whole_experts else cfg.split_sizes(whole_experts=False)
    if problem := indivisible_split(sizes, world, what):
        raise ValueError(problem)


def split(
    target: Transformer, drafter, rank: int, world: int, replicate_drafter: bool = False, whole_experts: bool = True
) -> str:
    """Shard a loaded target and its drafter (split_drafter says how the drafter runs)."""
    shard(target, rank, world, whole_experts)
    return split_drafter(target, drafter, replicate_drafter)


def split_drafter(target: Transformer, drafter, replicate_drafter: bool = False) -> str:
    """Shard the drafter like its (already sharded) target unless asked to replicate it or its heads do
    not divide (on 2 H200s with the Qwen3-8B shape, splitting made rounds faster and used less memory per
    GPU: docs/benchmarks.md, "Tensor parallel"). Returns how the drafter runs: "split", "replicated" or
    "none"."""
    if drafter is None:
        return "none"
    if replicate_drafter:
        return "replicated"
    assert target.tp is not None, "shard the target first"
    try:
        check_divisible(drafter.config, target.tp.world, "the drafter")
    except ValueError as exc:
        log.info("%s: every rank runs the whole drafter", exc)
        return "replicated"
    shard_drafter(drafter, target.tp)
    return "split"


@torch.no_grad()
def shard_drafter(drafter, tp: Collectives) -> None:
    """Split the drafter's layers like the target's (fc and the norms stay replicated). Its KV cache
    is then sharded by KV heads too; call before setup_caches (the Engine does that)."""
    check_divisible(drafter.config, tp.world, "the drafter")
    shard_dense_layers(drafter.layers, drafter.config, tp)


@torch.no_grad()
def shard(model: Transformer, rank: int, world: int, whole_experts: bool = True) -> Transformer:
    """Keep this rank's slice of every split weight (in place) and switch on the collectives. On a model
    on the meta device this only records the slices, which loading then reads (checkpoint.load_into).
    whole_experts: routed experts split whole over the ranks (expert parallelism), else by width.
    Quantized layers split with their scales; a share that would cut a scale group or block is refused,
    naming the layer."""
    cfg = model.config
    check_divisible(cfg, world, whole_experts=whole_experts)
    tp = TensorParallel(rank, world)
    use_backend(model, "reference")  # fused views point at the full weights; the shards are fused again
    try:
        model.shard_layers(tp, whole_experts)  # the family's split of its layers
    except QuantizedSplitError as exc:
        name = next(name for name, module in model.named_modules() if module is exc.module)
        raise ValueError(f"tensor parallel {world} cannot split {name}: {exc}") from None
    vocab = cfg.vocab_size // world
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    keep_rows(model.model.embed_tokens.weight, rank, vocab)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        keep_rows(model.lm_head.weight, rank, vocab)
    model.tp = tp
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(device_type: str) -> tuple[int, int]:
    """Join the process group described by torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return rank, world


def leave_group(engine=None) -> None:
    """Destroy the process groups (once). Under NCCL every rank must do it at about the same time:
    a rank that waits for a peer's exit before leaving deadlocks with that peer's teardown.
    The CUDA graphs go first (the engine's, and any that only a reference cycle still holds): they
    captured NCCL kernels of the communicator being torn down: on 2 H200s, ranks whose graphs were
    still alive hung in the teardown, and with this order they leave cleanly (docs/benchmarks.md,
    "Tensor parallel")."""
    if engine is not None:
        engine.graphs = None
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.destroy_process_group()


def _local_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun-style variables for a group of processes on this host, talking over the loopback device."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if sys.platform == "linux" and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the address the host name resolves to
    return env


def launch(world: int, fn, *args, device_type: str = "cpu"):
    """Run fn(rank, world, *args) in `world` fresh processes joined in one group; return rank 0's result."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.spawn(_rank_main, args=(world, free_port(), device_type, fn, args, queue), nprocs=world, join=False)
    # rank 0 cannot finish put() until the result is read (a pipe holds 64 KiB): read it while joining
    result, got = None, False
    while not ranks.join(timeout=0.1):  # raises if a rank failed
        if not got and not queue.empty():
            result, got = queue.get(), True
    return result if got else queue.get()


def _rank_main(rank: int, world: int, port: int, device_type: str, fn, args, queue) -> None:
    os.environ.update(_local_env(rank, world, port))
    init_from_env(device_type)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            queue.put(result)  # written to the pipe before put returns
    finally:
        leave_group()
    _exit_done()


def start_followers(world: int, fn, *args, device_type: str = "cpu") -> list:
    """Make this process rank 0 of a new `world`-rank group on this host: start ranks 1..world-1, each
    running fn(rank, world, *args) in a fresh process, and set this process's RANK/WORLD_SIZE/MASTER_*
    so that init_from_env() (from any thread) joins the group. Call it from the main thread: a follower
    is sent SIGKILL when the thread that started it ends (Linux parent-death signal), so a rank 0 that
    dies, however it dies, takes its followers with it."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_follower_main,
            args=(rank, world, port, device_type, os.getpid(), fn, args),
            name=f"ddtree-rank-{rank}",
        )
        for rank in range(1, world)
    ]
    for p in procs:
        p.start()
    os.environ.update(_local_env(0, world, port))
    return procs


def _follower_main(rank: int, world: int, port: int, device_type: str, parent: int, fn, args) -> None:
    _die_with_parent(parent)
    os.environ.update(_local_env(rank, world, port))
    init_from_env(device_type)
    fn(rank, world, *args)
    leave_group()
    _exit_done()


def _exit_done() -> None:
    """End a rank whose work is done and whose group is destroyed, without the interpreter's teardown. With
    gloo, rank 0 (which hosts the group's TCP store) was sometimes aborted there after its work was done
    ("terminate called without an active exception", no Python frame left; about 1 launch in 100 on CPU),
    and launch() then failed on a finished run. A failed rank still exits normally, so that spawn reports
    its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG (Linux only)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


# ---- serving: rank 0 leads, the other ranks replay its engine calls -----------------------------


class RankFailure(Exception):
    """The ranks are out of step (a broadcast, or a replayed call on rank 0, failed): the group cannot
    serve any more. Not a RuntimeError on purpose: the scheduler survives RuntimeErrors of one round,
    but after this one every later collective would hang or fail, so its engine thread must stop."""


ENGINE_CALLS = (
    "add",
    "add_many",
    "begin",
    "prefill",
    "prefill_many",
    "grow",
    "step",
    "release",
    "warm_up",
    "capture_graphs",
    "measure_budgets",
    "override",
    "smoke",
)


def command_group():
    """The group the commands travel on: gloo (on the CPU, whatever carries the tensors), with an
    unbounded timeout since followers wait for rank 0's next call as long as the server is idle. A rank
    that dies closes its connections, so the others' broadcast fails at once instead of waiting."""
    return dist.new_group(backend="gloo", timeout=timedelta(days=3650))


def _apply(engine, name: str, args: tuple, kwargs: dict):
    if name == "smoke":
        from .smoke import run_smoke

        return run_smoke(engine, *args, **kwargs)
    return getattr(engine, name)(*args, **kwargs)


class Leader:
    """Rank 0's engine: broadcasts each call that touches the model or the state later rounds depend on
    (ENGINE_CALLS) to the followers, then makes it on the local shard. Anything else (host_lengths,
    budget, check_request, ...) reads the local engine. Used from one thread at a time."""

    def __init__(self, engine, group) -> None:
        self.engine, self.group = engine, group
        self.failed: BaseException | None = None

    def __getattr__(self, name: str):  # only for names this class does not define
        if name in ("engine", "generate", "round", "propose", "build_tree"):  # would run rank 0 alone
            raise AttributeError(f"Leader has no '{name}' (only {', '.join(ENGINE_CALLS)} run on every rank)")
        return getattr(self.engine, name)

    def add(self, row: int, prompt: list[int], params) -> int:
        return self._call("add", row, list(prompt), params)

    def add_many(self, rows: list[int], prompts: list[list[int]], params) -> list[int]:
        return self._call("add_many", list(rows), [list(p) for p in prompts], params)

    def begin(self, row: int, prompt: list[int], params, reuse: bool = False) -> int:
        return self._call("begin", row, list(prompt), params, reuse=reuse)

    def prefill(self, row: int, budget: int) -> int | None:
        return self._call("prefill", row, budget)

    def prefill_many(self, takes: list[tuple[int, int]]) -> list[int | None]:
        return self._call("prefill_many", [(row, take) for row, take in takes])

    def grow(self, row: int) -> bool:
        return self._call("grow", row)

    def step(self, n: int) -> list[list[int]]:
        # budget auto: rank 0 chooses (from its own measurements), so that every rank replays the same graph
        budget = self.engine.choose_budget(n) if self.engine.budgets is not None else None
        return self._call("step", n, budget)

    def measure_budgets(self) -> dict:
        return self._call("measure_budgets")

    def override(self, fixes: dict) -> dict[int, int]:
        return self._call("override", fixes)

    def warm_up(self) -> float:
        return self._call("warm_up")

    def release(self, row: int) -> None:
        if self.failed is not None:  # local bookkeeping only: nobody is listening any more
            return self.engine.release(row)
        return self._call("release", row)

    def capture_graphs(self, **kwargs) -> float:
        return self._call("capture_graphs", **kwargs)

    def smoke(self, *args, **kwargs):
        """ddtree.runtime.smoke.run_smoke(engine, *args, **kwargs) on every rank."""
        return self._call("smoke", *args, **kwargs)

    def stop(self) -> None:
        """Tell the followers to leave `follow` (once the scheduler no longer uses this engine)."""
        if self.failed is None:
            self._send(("stop", (), {}))
            self.failed = RankFailure("stopped")

    def _send(self, command: tuple) -> None:
        try:
            dist.broadcast_object_list([command], src=0, group=self.group)
        except Exception as exc:
            self.failed = exc
            raise RankFailure(f"broadcast of {command[0]} to the other ranks failed: {exc}") from exc

    def _call(self, name: str, *args, **kwargs):
        if self.failed is not None:
            raise RankFailure(f"the tensor parallel group is unusable: {self.failed}")
        self._send((name, args, kwargs))
        try:
            return _apply(self.engine, name, args, kwargs)
        except ValueError:  # a refused request: every rank refuses it the same way, before any collective
            raise
        except Exception as exc:
            self.failed = exc
            raise RankFailure(
                f"{name} failed on rank 0, the ranks are out of step: {type(exc).__name__}: {exc}"
            ) from exc


def follow(engine, group) -> None:
    """Ranks 1..N-1: replay rank 0's engine calls on this shard until it sends stop. A ValueError (a
    refused request) happens on rank 0 as well, at the same point, so it is skipped; any other error
    ends this rank (and so breaks the group: rank 0 fails its next call)."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        name, args, kwargs = box[0]
        if name == "stop":
            return
        if name not in ENGINE_CALLS:
            raise RankFailure(f"unknown command '{name}' from rank 0")
        try:
            _apply(engine, name, args, kwargs)
        except ValueError as exc:
            log.debug("rank 0 refused it too: %s", exc)
