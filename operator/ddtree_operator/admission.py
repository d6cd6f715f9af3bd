"""The spec checks that need the models' config files: pure functions, run by the admission webhook when a
SpeculativeDeployment is applied and again by reconcile (one code path), so a cluster without the webhook
reports the same problems as a condition.

- the drafter fits the model: vocabulary, hidden size, the target layers it taps, its mask token
  (ddtree.speculative.compat, the engine's own comparison at load);
- the model splits over `spec.parallelism.tensor` GPUs: attention heads, KV heads, MLP width, vocabulary,
  and the experts (whole per rank) or every expert's width (`spec.parallelism.expert` 1), as the engine's
  runtime/parallel.check_divisible refuses them (sizes from ddtree.models.memory, torch-free);
- the model fits its GPUs: fit.py's memory plan.

`config_refs(spec)` says which hub config.json files the checks need; `run_checks(spec, configs)` makes them
from what was fetched. A config that cannot be had (the hub unreachable or slow, a `pvc://` volume, which the
operator does not mount) leaves its checks undone and never refuses: the engine still checks at load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ddtree.models.builtin import builtin_config
from ddtree.models.memory import indivisible_split, target_layout
from ddtree.models.registry import family_for
from ddtree.speculative.compat import DrafterMismatchError, config_mismatches, method_problem

from .api import SpeculativeDeploymentSpec
from .fit import ConfigRef, MemoryCheck, decide, hub_ref, plan_inputs

# A config.json to fetch from the hub, the config itself (a built-in model), or why there is none.
Source = ConfigRef | dict[str, Any] | str
Fetched = Mapping[ConfigRef, dict[str, Any] | str]  # each fetched ref's config.json, or why it could not be had


def config_source(uri: str, revision: str | None) -> Source:
    config = builtin_config(uri)
    return config if config is not None else hub_ref(uri, revision)


@dataclasses.dataclass(frozen=True)
class Compatibility:
    """The outcome of the config checks: `problems` refuse the spec, `unchecked` says which checks could not
    be made and why."""

    problems: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()

    @property
    def blocks(self) -> bool:
        """Whether the operator must not create or change the resource's objects."""
        return bool(self.problems)

    @property
    def message(self) -> str:
        if self.problems:
            return "; ".join(self.problems)
        if self.unchecked:
            return "not checked: " + "; ".join(self.unchecked)
        return "the drafter fits the model and the model splits over its GPUs"

    def condition(self) -> tuple[str, str, str]:
        """The `Compatible` condition: status, reason, message."""
        if self.problems:
            return "False", "Incompatible", self.message
        if self.unchecked:
            return "Unknown", "ConfigUnavailable", self.message
        return "True", "Compatible", self.message


def _fetched(source: Source, fetched: Fetched) -> dict[str, Any] | str:
    if isinstance(source, ConfigRef):
        return fetched.get(source, "not fetched")
    return source


def split_problem(config: dict[str, Any], tensor: int, expert: int | None) -> str | None:
    """The engine's refusal of a split that does not divide the model (runtime/parallel.check_divisible),
    or None. ValueError for a config the sizes cannot be read from."""
    return indivisible_split(target_layout(config, tensor, expert).split_sizes, tensor)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())[:300]


def check_configs(spec: SpeculativeDeploymentSpec, fetched: Fetched) -> Compatibility:
    """The drafter and split checks of `spec` from the fetched configs (see `config_refs`)."""
    problems: list[str] = []
    unchecked: list[str] = []
    model = spec.model.uri
    target = _fetched(config_source(model, spec.model.revision), fetched)
    if isinstance(target, str):
        unchecked.append(f"the config of spec.model {model}: {target}")
    else:
        try:
            family_for(target)
        except ValueError as exc:  # the engine refuses it at load with the same words
            problems.append(f"spec.model {model}: {exc}")
        else:
            try:
                split = split_problem(target, spec.parallelism.tensor, spec.parallelism.expert)
            except (ValueError, KeyError, TypeError) as exc:
                unchecked.append(f"the split of spec.model {model}: its config cannot be read: {_one_line(exc)}")
            else:
                if split is not None:
                    problems.append(split)
    if spec.drafter is not None:
        uri = spec.drafter.uri
        drafter = _fetched(config_source(uri, spec.drafter.revision), fetched)
        if isinstance(drafter, str):
            unchecked.append(f"the config of spec.drafter {uri}: {drafter}")
        elif not isinstance(target, str):
            try:
                mismatches = config_mismatches(drafter, target)
            except DrafterMismatchError as exc:
                problems.append(f"spec.drafter {uri}: {exc}")
            except (ValueError, KeyError, TypeError) as exc:
                unchecked.append(f"the drafter of spec.drafter {uri}: its config cannot be read: {_one_line(exc)}")
            else:
                if mismatches:
                    problems.append(f"spec.drafter {uri} does not fit spec.model {model}: " + "; ".join(mismatches))
        if not isinstance(drafter, str):
            architecture = (drafter.get("architectures") or ["DFlashDraftModel"])[0]
            problem = method_problem(spec.speculation.method, str(architecture))
            if problem:
                problems.append(f"spec.drafter {uri}: {problem}")
    return Compatibility(tuple(problems), tuple(unchecked))


@dataclasses.dataclass(frozen=True)
class SpecChecks:
    """Every check of one spec that reads the models' configs."""

    compatibility: Compatibility
    memory: MemoryCheck

    @property
    def blocks(self) -> bool:
        return self.compatibility.blocks or self.memory.blocks

    def refusal(self) -> str | None:
        """The one message the webhook refuses the spec with, or None to admit it."""
        problems = list(self.compatibility.problems)
        # a split that does not divide is also the plan's reason: say it once
        if self.memory.blocks and self.memory.message not in problems:
            problems.append(f"the model does not fit its GPUs: {self.memory.message}")
        return "; ".join(problems) or None


def config_refs(spec: SpeculativeDeploymentSpec) -> list[ConfigRef]:
    """The hub config.json files the checks of `spec` read."""
    sources = [config_source(spec.model.uri, spec.model.revision)]
    if spec.drafter is not None:
        sources.append(config_source(spec.drafter.uri, spec.drafter.revision))
    inputs = plan_inputs(spec)
    refs = [s for s in sources if isinstance(s, ConfigRef)]
    refs += [] if isinstance(inputs, MemoryCheck) else inputs.refs
    return list(dict.fromkeys(refs))


def run_checks(spec: SpeculativeDeploymentSpec, fetched: Fetched) -> SpecChecks:
    inputs = plan_inputs(spec)
    memory = inputs if isinstance(inputs, MemoryCheck) else decide(inputs, fetched)
    return SpecChecks(check_configs(spec, fetched), memory)
