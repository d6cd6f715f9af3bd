"""The fit check: does the spec's model fit its GPUs? Pure functions around the engine's memory plan.

`plan_inputs(spec)` says what the check needs (the hub configs to fetch and the engine settings) or why it is
skipped; `decide(inputs, configs)` turns the fetched config.json dicts into a `MemoryCheck`. Fetching is the
handlers' job. The plan is `ddtree.models.memory.plan_memory`, the engine's own count (torch-free, so the
operator image, which has no torch, can import it). A check that cannot be made never blocks: only a plan
that says "does not fit" does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

from ddtree.config import ServingConfig
from ddtree.models.memory import MemoryPlan, default_max_context, parse_size, plan_memory
from ddtree.runtime.plan import AUTO_BUDGETS

from .api import SpeculativeDeploymentSpec

# What the engine takes for a hub id (ddtree.models.checkpoint.resolve_model): org/name.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
RANDOM_PREFIX = "random:"
DEFAULT_REVISION = "main"
DEFAULT_DTYPE = "bfloat16"  # the engine's dtype on a GPU when --dtype is not given
SKIPPED = "memory plan skipped: "

Result = Literal["Fits", "DoesNotFit", "Skipped"]


@dataclasses.dataclass(frozen=True)
class MemoryCheck:
    """The outcome for one spec: `status()` is what `.status.memoryPlan` shows."""

    result: Result
    message: str
    per_rank_bytes: dict[str, int] | None = None
    max_context_that_fits: int | None = None

    @property
    def blocks(self) -> bool:
        """Whether the operator must not create or change the resource's objects."""
        return self.result == "DoesNotFit"

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"result": self.result, "message": self.message}
        if self.per_rank_bytes is not None:
            out["perRankBytes"] = dict(self.per_rank_bytes)
        if self.max_context_that_fits is not None:
            out["maxContextThatFits"] = self.max_context_that_fits
        return out


def skipped(why: str) -> MemoryCheck:
    return MemoryCheck("Skipped", SKIPPED + why)


@dataclasses.dataclass(frozen=True)
class ConfigRef:
    """A hub repository's config.json at a revision."""

    repo: str
    revision: str


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    target: ConfigRef
    drafter: ConfigRef | None  # None: no drafter, or one whose config is not on the hub
    drafter_unavailable: str | None  # why a drafter the spec names has no config to plan with
    gpus: int
    gpu_memory: int
    max_context: int | None  # None: the engine's default for the model (default_max_context)
    max_batch: int
    kv_cache_tokens: int | None
    gpu_memory_utilization: float | None
    dtype: str
    budget: int | None
    expert_parallel: int | None

    @property
    def refs(self) -> list[ConfigRef]:
        return [self.target] + ([self.drafter] if self.drafter is not None else [])


def hub_ref(uri: str, revision: str | None) -> ConfigRef | str:
    """The hub config of a model uri, or why it has none the operator can fetch."""
    ref = uri.removeprefix("hf://")
    if ref.startswith(RANDOM_PREFIX):
        return f"{uri} is a random-weight model (its shapes live in the engine's torch code)"
    if uri.startswith("pvc://") or ref.startswith(("/", ".", "~")) or ref.endswith(".gguf"):
        return f"{uri} is not on the hub (a volume or a path in the image)"
    if not HUB_ID.fullmatch(ref):
        return f"{uri} is a built-in model, not a hub id"
    return ConfigRef(ref, revision or DEFAULT_REVISION)


def engine_flag(args: list[str], flag: str) -> str | None:
    """The value `ddtree serve` takes for `flag` from spec.engine.args (which override the file): the last
    `--flag V` or `--flag=V`."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _budget(spec: SpeculativeDeploymentSpec) -> int | None:
    speculation = spec.speculation
    if speculation.method != "ddtree":
        return None  # dflash drafts one block; none drafts nothing
    if speculation.budget_by_batch_size:  # the largest tree any batch size builds
        return max(s.budget for s in speculation.budget_by_batch_size)
    if isinstance(speculation.budget, str):  # auto: buffers fit the largest budget it chooses from
        return max(AUTO_BUDGETS)
    return speculation.budget


def plan_inputs(spec: SpeculativeDeploymentSpec) -> PlanInputs | MemoryCheck:
    """What the plan of this spec needs, or the skipped check saying why there is none."""
    if spec.resources.gpu_memory is None:
        return skipped("spec.resources.gpuMemory is not set")
    target = hub_ref(spec.model.uri, spec.model.revision)
    if isinstance(target, str):
        return skipped(target)
    drafter: ConfigRef | str | None = None
    if spec.drafter is not None:
        drafter = hub_ref(spec.drafter.uri, spec.drafter.revision)
    args = spec.engine.args
    try:
        flag = engine_flag(args, "--max-seq-len")
        max_context = int(flag) if flag is not None else spec.engine.max_seq_len
        max_batch = int(
            engine_flag(args, "--max-batch-size") or spec.engine.max_batch_size or ServingConfig.max_batch_size
        )
        pool = engine_flag(args, "--kv-cache-tokens")
        kv_cache_tokens = int(pool) if pool is not None else spec.engine.kv_cache_tokens
        share = engine_flag(args, "--gpu-memory-utilization")
        gpu_memory_utilization = float(share) if share is not None else spec.engine.gpu_memory_utilization
        expert = engine_flag(args, "--expert-parallel")
        expert_parallel = int(expert) if expert is not None else spec.parallelism.expert
    except ValueError as exc:
        return skipped(f"spec.engine.args: {exc}")
    return PlanInputs(
        target=target,
        drafter=drafter if isinstance(drafter, ConfigRef) else None,
        drafter_unavailable=drafter if isinstance(drafter, str) else None,
        gpus=spec.parallelism.tensor,
        gpu_memory=parse_size(spec.resources.gpu_memory),
        max_context=max_context,
        max_batch=max_batch,
        kv_cache_tokens=kv_cache_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=engine_flag(args, "--dtype") or DEFAULT_DTYPE,
        budget=_budget(spec),
        expert_parallel=expert_parallel,
    )


def _one_line(text: object) -> str:
    return " ".join(str(text).split())[:300]


def _check(result: Result, message: str, plan: MemoryPlan) -> MemoryCheck:
    return MemoryCheck(result, message, dict(plan.per_rank_bytes), plan.max_context_that_fits)


def _plan(inputs: PlanInputs, target: dict[str, Any], drafter: dict[str, Any] | None) -> MemoryPlan:
    return plan_memory(
        target,
        gpus=inputs.gpus,
        gpu_memory=inputs.gpu_memory,
        max_context=default_max_context(target) if inputs.max_context is None else inputs.max_context,
        max_batch=inputs.max_batch,
        kv_cache_tokens=inputs.kv_cache_tokens,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        dtype=inputs.dtype,
        drafter_config=drafter,
        budget=inputs.budget,
        expert_parallel=inputs.expert_parallel,
    )


def decide(inputs: PlanInputs, configs: Mapping[ConfigRef, dict[str, Any] | str]) -> MemoryCheck:
    """The check from the fetched configs: each ref of `inputs.refs` maps to its config.json dict, or to why
    it could not be fetched. Without the drafter's config the target is planned alone: a lower bound, so
    "does not fit" still holds, while "fits" cannot be claimed (skipped)."""
    target = configs.get(inputs.target, "not fetched")
    if isinstance(target, str):
        return skipped(f"cannot get the config of {inputs.target.repo}: {target}")
    try:
        alone = _plan(inputs, target, None)
    except Exception as exc:  # a config the plan cannot read (any error) skips the check: it must never block
        return skipped(f"no plan for {inputs.target.repo}: {_one_line(exc)}")
    missing = inputs.drafter_unavailable
    if inputs.drafter is not None:
        drafter = configs.get(inputs.drafter, "not fetched")
        if isinstance(drafter, str):
            missing = f"cannot get the config of {inputs.drafter.repo}: {drafter}"
        else:
            try:
                plan = _plan(inputs, target, drafter)
            except Exception as exc:
                missing = f"no plan for the drafter {inputs.drafter.repo}: {_one_line(exc)}"
            else:
                return _check("Fits" if plan.fits else "DoesNotFit", plan.reason, plan)
    if missing is None:  # no drafter (method none)
        return _check("Fits" if alone.fits else "DoesNotFit", alone.reason, alone)
    if not alone.fits:
        return _check("DoesNotFit", f"{alone.reason} (the target alone; the drafter is not counted: {missing})", alone)
    return _check("Skipped", f"{SKIPPED}{missing}; the target alone fits: {alone.reason}", alone)
