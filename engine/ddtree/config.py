"""One typed configuration for the engine commands (`generate`, `serve`, `smoke`, `bench`).

Settings come from three places, in rising precedence: the dataclass defaults below, a YAML or JSON file
(`--config FILE`, read by `EngineConfig.from_file`), and the flags the user actually typed
(`EngineConfig.from_args`: the engine flags have no argparse defaults, so an untyped flag never hides a
file value). The file uses the field names of the dataclasses, one section per dataclass:

    model:       {id, revision, drafter, drafter_revision, dtype, device, trust_remote_code}
    speculation: {method, budget, block_size}
    kernels:     {backend, graphs, batch_buckets}
    parallel:    {tensor_parallel, expert_parallel, replicate_drafter}
    serving:     {host, port, max_batch_size, max_seq_len, kv_cache_tokens, prefill_chunk, prefix_cache,
                  max_waiting, served_model_name,
                  termination_log, api_key_file, parse_special_tokens, tool_call_parser, reasoning_parser,
                  max_logprobs,
                  max_connections,
                  header_timeout, body_timeout, keepalive_timeout}

Defaults and validation live here; a bad value raises `ConfigError`, one line naming the field (the flag
when it came from the command line, `section.field` otherwise). docs/engine.md, "Configuration", lists
every field. No torch import at module level: the command line validates before loading anything.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

AUTO = "auto"  # speculation.budget chosen every round (ddtree.runtime.budget)

METHODS = ("ar", "dflash", "ddtree")
KERNEL_CHOICES = ("auto", "torch", "triton")
TOOL_CALL_PARSERS = ("auto", "hermes", "kimi_k2", "none")  # ddtree.serving.tools.FORMATS, auto and none
REASONING_PARSERS = ("auto", "think", "none")  # ddtree.serving.reasoning
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
DEFAULT_MAX_SEQ_LEN = 2048  # serve and smoke, when serving.max_seq_len is not set
PAGE_SIZE = 16  # KV cache slots per page (runtime/pages.py): the unit of sharing and of allocation
DEFAULT_SMOKE_BUCKETS = (1, 2, 4)  # smoke, when kernels.batch_buckets is not set


SMOKE_FAULTS = ("corrupt-graph-input",)  # faults the smoke test can inject, to test that it fails


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class ConfigError(ValueError):
    """A bad setting: one line that names the field. The command line prints it and exits 2."""


@dataclass(frozen=True)
class ModelRef:
    """What to load. `id`: built-in id, local folder, .gguf file, hub id, or random:SHAPE (cost runs)."""

    id: str | None = None
    revision: str | None = None  # hub revision of id (branch, tag or commit)
    drafter: str | None = None  # DFlash drafter (default: the built-in one of a built-in target)
    drafter_revision: str | None = None
    dtype: str | None = None  # float32 / bfloat16 / float16 (default: bfloat16 on cuda, float32 on cpu)
    device: str | None = None  # cpu / cuda / cuda:N (default: cuda when available)
    # run the checkpoint's own tokenizer code (Kimi's tiktoken tokenizer ships as tokenization_kimi.py)
    trust_remote_code: bool = False


@dataclass(frozen=True)
class SpeculationConfig:
    method: str = "ddtree"  # ar | dflash | ddtree
    # node budget, {max batch size: budget}, or "auto" (chosen every round; serve's default for ddtree);
    # default elsewhere block_size-1
    budget: int | dict[int, int] | str | None = None
    block_size: int | None = None  # expected drafter block size (checked against the drafter)


@dataclass(frozen=True)
class KernelConfig:
    backend: str = "auto"  # element-wise path of the target: auto | torch | triton
    graphs: bool = True  # capture CUDA graphs (on a GPU)
    batch_buckets: tuple[int, ...] | None = None  # graph batch sizes (serve: powers of two up to max_batch_size)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel: int = 1
    # ranks the routed experts are split over, whole experts per rank (default: all of tensor_parallel);
    # 1 splits every expert's width over the ranks instead, like a dense MLP
    expert_parallel: int | None = None
    replicate_drafter: bool = False


@dataclass(frozen=True)
class ServingConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8  # serve's engine rows (generate runs 1, smoke its largest batch bucket)
    # the most tokens of one request, at most the model's context (max_position_embeddings): default 2048 or
    # that context where shorter; generate: prompt + max new tokens
    max_seq_len: int | None = None
    # the KV cache's page pool, in tokens shared by all rows (default: max_batch_size rows of max_seq_len);
    # fewer lets long contexts and many short requests share memory: requests are admitted by free pages
    kv_cache_tokens: int | None = None
    # or, on CUDA, the pool that keeps the engine's memory plan (models/memory.py: weights, caches, a round's
    # workspace, reserve) within this share of each GPU's memory, and within what the GPU has free
    gpu_memory_utilization: float | None = None
    # the most prompt tokens one prefill forward takes, and what a scheduler iteration prefills between two
    # rounds: a long prompt goes in chunks, so running streams keep getting tokens while it is admitted
    prefill_chunk: int = 2048
    # a prompt that starts like text some engine row's caches still hold (a shared system prompt, the earlier
    # turns of a conversation) prefills only the rest: the row keeps it, or it is copied from the other row
    prefix_cache: bool = True
    max_waiting: int | None = None  # queued requests beyond the rows before 429 (default 4 x rows)
    served_model_name: str | None = None  # model name in the API (default: model.id)
    termination_log: str | None = None  # failure reason file (default /dev/termination-log when present)
    api_key_file: str | None = None  # API keys, one per line: /v1/* then needs `Authorization: Bearer KEY`
    # control-token text in prompts and messages (`<|im_start|>`) is tokenized as plain text unless set:
    # only for deployments whose every client is trusted to write the model's control tokens
    parse_special_tokens: bool = False
    # how tool calls are read from the generated text: hermes, kimi_k2, none, or auto (from the chat template)
    tool_call_parser: str = "auto"
    # how chat answers' reasoning is read out of the text: think (<think>...</think>), none, or auto (think
    # when the chat template writes <think>)
    reasoning_parser: str = "auto"
    # the most top tokens a request may ask log-probabilities for; 0 refuses logprobs and response_format,
    # and saves keeping the accepted path's logits every round
    max_logprobs: int = 20
    max_connections: int = 1024  # open client connections; beyond it a connection gets 503 and is closed
    header_timeout: float = 30.0  # seconds from a request's first byte to the end of its headers
    body_timeout: float = 60.0  # seconds to receive a request's body once its headers are in
    keepalive_timeout: float = 75.0  # seconds an idle kept-alive connection stays open

    @property
    def seq_len(self) -> int:
        return DEFAULT_MAX_SEQ_LEN if self.max_seq_len is None else self.max_seq_len

    @property
    def waiting_limit(self) -> int:
        return 4 * self.max_batch_size if self.max_waiting is None else self.max_waiting


SECTIONS = {
    "model": ModelRef,
    "speculation": SpeculationConfig,
    "kernels": KernelConfig,
    "parallel": ParallelConfig,
    "serving": ServingConfig,
}

# flag dest -> field, for the flags `generate`, `serve` and `smoke` share with the file
FLAGS = {
    "model": "model.id",
    "revision": "model.revision",
    "drafter": "model.drafter",
    "drafter_revision": "model.drafter_revision",
    "dtype": "model.dtype",
    "device": "model.device",
    "method": "speculation.method",
    "budget": "speculation.budget",
    "block_size": "speculation.block_size",
    "kernels": "kernels.backend",
    "no_graphs": "kernels.graphs",
    "batch_buckets": "kernels.batch_buckets",
    "tensor_parallel": "parallel.tensor_parallel",
    "expert_parallel": "parallel.expert_parallel",
    "replicate_drafter": "parallel.replicate_drafter",
    "trust_remote_code": "model.trust_remote_code",
    "host": "serving.host",
    "port": "serving.port",
    "max_batch_size": "serving.max_batch_size",
    "max_seq_len": "serving.max_seq_len",
    "kv_cache_tokens": "serving.kv_cache_tokens",
    "gpu_memory_utilization": "serving.gpu_memory_utilization",
    "prefill_chunk": "serving.prefill_chunk",
    "no_prefix_cache": "serving.prefix_cache",
    "max_waiting": "serving.max_waiting",
    "served_model_name": "serving.served_model_name",
    "termination_log": "serving.termination_log",
    "api_key_file": "serving.api_key_file",
    "parse_special_tokens": "serving.parse_special_tokens",
    "tool_call_parser": "serving.tool_call_parser",
    "reasoning_parser": "serving.reasoning_parser",
    "max_logprobs": "serving.max_logprobs",
    "max_connections": "serving.max_connections",
    "header_timeout": "serving.header_timeout",
    "body_timeout": "serving.body_timeout",
    "keepalive_timeout": "serving.keepalive_timeout",
}
INVERTED = {"no_graphs", "no_prefix_cache"}  # store_true flags that switch a field off


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def parse_int_list(text: str, name: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; ConfigError naming `name` otherwise."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name} takes comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{name} needs positive integers, got '{text}'")
    return values


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coerce(path: str, value, annotation: str, name: str):
    """A file or flag value as the field's type (the file's YAML/JSON types are checked here)."""
    if value is None:
        if "None" in annotation:
            return None
        raise ConfigError(f"{name} must not be null")
    if path == "speculation.budget":
        return _budget(value, name)
    if path == "kernels.batch_buckets":
        if isinstance(value, str):
            return tuple(parse_int_list(value, name))
        if not isinstance(value, (list, tuple)) or not value or not all(_int(v) and v >= 1 for v in value):
            raise ConfigError(f"{name} must be a non-empty list of positive integers, got {value!r}")
        return tuple(value)
    kind = annotation.split("|")[0].strip()
    if kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if kind == "int" and not _int(value):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if kind == "float":
        return float(value)
    if kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def _budget(value, name: str) -> int | dict[int, int] | str:
    if value == AUTO:
        return value
    if isinstance(value, str):  # the flag's syntax: 32 or 1:32,16:8
        try:
            value = int(value) if ":" not in value else dict(p.split(":") for p in value.split(","))
        except ValueError:
            raise ConfigError(
                f"{name} takes an integer, BATCH:BUDGET pairs like 1:32,16:8 or '{AUTO}', got '{value}'"
            ) from None
    if _int(value):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return value
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{name} must be an integer or a mapping of batch size to budget, got {value!r}")
    try:  # JSON keys are strings
        policy = {int(n): int(b) for n, b in value.items() if not isinstance(b, bool)}
    except (TypeError, ValueError):
        policy = {}
    if len(policy) != len(value) or min(policy) < 1 or min(policy.values()) < 0:
        raise ConfigError(f"{name}: batch sizes must be >= 1 and budgets >= 0, got {value!r}")
    return policy


def _read(path: str | os.PathLike) -> dict:
    """The mapping in a YAML or JSON file (JSON is read by the YAML parser too)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        if str(path).endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError's message, first line
        raise ConfigError(f"config file {path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # noqa: BLE001 - yaml.YAMLError (yaml is imported lazily)
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}"
        )
    return data


@dataclass(frozen=True)
class EngineConfig:
    model: ModelRef = field(default_factory=ModelRef)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, *, names: dict[str, str] | None = None, source: str | None = None) -> EngineConfig:
        """From nested sections (the file layout); unknown sections and keys are refused. `names` maps
        `section.field` to how error messages call it (the flag, for values from the command line)."""
        names = dict(names or {})
        where = f" in {source}" if source else ""
        if not isinstance(data, dict):
            raise ConfigError(f"the configuration{where} must be a mapping of sections, got {type(data).__name__}")
        for key in data:
            if key not in SECTIONS:
                raise ConfigError(f"unknown section '{key}'{where} (known: {', '.join(SECTIONS)})")
        sections = {}
        for key, kind in SECTIONS.items():
            given = data.get(key) or {}
            if not isinstance(given, dict):
                raise ConfigError(f"section '{key}'{where} must be a mapping, got {type(given).__name__}")
            known = {f.name: f for f in fields(kind)}
            values = {}
            for name, value in given.items():
                if name not in known:
                    raise ConfigError(f"unknown key '{key}.{name}'{where} (known in {key}: {', '.join(known)})")
                path = f"{key}.{name}"
                values[name] = _coerce(path, value, str(known[name].type), names.get(path, path))
            sections[key] = kind(**values)
        config = cls(**sections)
        object.__setattr__(config, "_names", names)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> EngineConfig:
        return cls.from_dict(_read(path), source=str(path))

    @classmethod
    def from_args(cls, args, flags: dict[str, str] = FLAGS) -> EngineConfig:
        """The file of `--config` (if any) overridden by the flags in `flags` that were typed: an engine
        flag that was not typed is absent from `args` (argparse.SUPPRESS) or None."""
        path = getattr(args, "config", None)
        data = _read(path) if path else {}
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        names = {}
        for dest, target in flags.items():
            value = getattr(args, dest, None)
            if value is None:
                continue
            section, name = target.split(".")
            flag = _flag(dest)
            if dest in INVERTED:
                value = not value
            elif target == "kernels.batch_buckets":
                value = parse_int_list(value, flag)
            if not isinstance(data.setdefault(section, {}), dict):
                raise ConfigError(f"section '{section}' in {path} must be a mapping")
            data[section][name] = value
            names[target] = flag
        for dest, target in flags.items():  # defaults and missing values are named by their flag too
            if target not in names and target.split(".")[1] not in (data.get(target.split(".")[0]) or {}):
                names[target] = _flag(dest)
        if not (data.get("model") or {}).get("id"):
            raise ConfigError(
                "the following arguments are required: --model"
                if not path
                else f"no model: set model.id in {path} or pass --model"
            )
        return cls.from_dict(data, names=names, source=path)

    def to_dict(self) -> dict:
        """Nested sections with the file's field names (from_dict(to_dict()) gives the same config)."""
        out = asdict(self)
        buckets = out["kernels"]["batch_buckets"]
        out["kernels"]["batch_buckets"] = list(buckets) if buckets is not None else None
        return out

    def name(self, path: str) -> str:
        """How messages call a field: its flag when it came from (or defaults on) the command line."""
        return getattr(self, "_names", {}).get(path, path)

    def replace(self, **sections: dict) -> EngineConfig:
        """A copy with some fields changed: config.replace(serving={"max_batch_size": 1})."""
        changed = {k: replace(getattr(self, k), **v) for k, v in sections.items()}
        out = replace(self, **changed)
        object.__setattr__(out, "_names", getattr(self, "_names", {}))
        return out

    # ---- validation --------------------------------------------------------------------------

    def validate(self) -> None:
        n, m, s, k, p, v = self.name, self.model, self.speculation, self.kernels, self.parallel, self.serving
        if not m.id:
            raise ConfigError(f"{n('model.id')} is required")
        if m.device is not None and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", m.device):
            raise ConfigError(f"{n('model.device')} must be cpu, cuda or cuda:N, got '{m.device}'")
        if m.dtype is not None and m.dtype not in DTYPE_NAMES:
            raise ConfigError(f"unknown {n('model.dtype')} '{m.dtype}' (choose from float32, bfloat16, float16)")
        if s.method not in METHODS:
            raise ConfigError(f"{n('speculation.method')} must be one of {', '.join(METHODS)}, got '{s.method}'")
        if isinstance(s.budget, dict) and s.method != "ddtree":
            method = n("speculation.method")
            raise ConfigError(f"a budget per batch size needs {method} ddtree (got {method} {s.method})")
        if s.budget == AUTO and s.method != "ddtree":
            method = n("speculation.method")
            raise ConfigError(f"{n('speculation.budget')} {AUTO} needs {method} ddtree (got {method} {s.method})")
        if s.block_size is not None and s.block_size < 2:
            raise ConfigError(f"{n('speculation.block_size')} must be >= 2, got {s.block_size}")
        if k.backend not in KERNEL_CHOICES:
            raise ConfigError(f"{n('kernels.backend')} must be one of {', '.join(KERNEL_CHOICES)}, got '{k.backend}'")
        if p.tensor_parallel < 1:
            raise ConfigError(f"{n('parallel.tensor_parallel')} must be >= 1, got {p.tensor_parallel}")
        if p.expert_parallel is not None and p.expert_parallel not in (1, p.tensor_parallel):
            raise ConfigError(
                f"{n('parallel.expert_parallel')} must be 1 or {n('parallel.tensor_parallel')} "
                f"({p.tensor_parallel}), got {p.expert_parallel}"
            )
        if p.replicate_drafter and p.tensor_parallel == 1 and "WORLD_SIZE" not in os.environ:
            raise ConfigError(f"{n('parallel.replicate_drafter')} needs {n('parallel.tensor_parallel')} > 1")
        if v.max_batch_size < 1:
            raise ConfigError(f"{n('serving.max_batch_size')} must be >= 1, got {v.max_batch_size}")
        if v.max_seq_len is not None and v.max_seq_len < 16:
            raise ConfigError(f"{n('serving.max_seq_len')} must be >= 16, got {v.max_seq_len}")
        if v.kv_cache_tokens is not None and v.kv_cache_tokens < v.seq_len:
            raise ConfigError(
                f"{n('serving.kv_cache_tokens')} must hold one request of {n('serving.max_seq_len')} "
                f"({v.seq_len} tokens), got {v.kv_cache_tokens}"
            )
        if v.gpu_memory_utilization is not None:
            if v.kv_cache_tokens is not None:
                raise ConfigError(
                    f"give {n('serving.kv_cache_tokens')} or {n('serving.gpu_memory_utilization')}, not both"
                )
            if not 0 < v.gpu_memory_utilization <= 1:
                raise ConfigError(
                    f"{n('serving.gpu_memory_utilization')} must be more than 0 and at most 1, "
                    f"got {v.gpu_memory_utilization}"
                )
        if v.prefill_chunk < 16 or v.prefill_chunk & (v.prefill_chunk - 1):
            raise ConfigError(f"{n('serving.prefill_chunk')} must be a power of two >= 16, got {v.prefill_chunk}")
        if not 0 <= v.port <= 65535:
            raise ConfigError(f"{n('serving.port')} must be in 0..65535, got {v.port}")
        if v.max_waiting is not None and v.max_waiting < 0:
            raise ConfigError(f"{n('serving.max_waiting')} must be >= 0, got {v.max_waiting}")
        if v.served_model_name is not None and not v.served_model_name.strip():
            raise ConfigError(f"{n('serving.served_model_name')} must not be empty")
        if not 0 <= v.max_logprobs <= 1000:
            raise ConfigError(f"{n('serving.max_logprobs')} must be in 0..1000, got {v.max_logprobs}")
        if v.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(
                f"{n('serving.tool_call_parser')} must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got '{v.tool_call_parser}'"
            )
        if v.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(
                f"{n('serving.reasoning_parser')} must be one of {', '.join(REASONING_PARSERS)}, "
                f"got '{v.reasoning_parser}'"
            )
        if v.max_connections < 1:
            raise ConfigError(f"{n('serving.max_connections')} must be >= 1, got {v.max_connections}")
        for timeout in ("header_timeout", "body_timeout", "keepalive_timeout"):
            if not 0 < getattr(v, timeout) < float("inf"):
                raise ConfigError(f"{n('serving.' + timeout)} must be a positive number of seconds")

    # ---- resolution (what the commands run with) ---------------------------------------------

    def resolve(self, default_drafter: bool = True) -> EngineConfig:
        """Device and dtype made concrete (cuda when available; bfloat16 on cuda, float32 on cpu) and,
        for a drafting method without a drafter, the built-in target's drafter filled in."""
        import torch

        device = self.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"{self.name('model.device')} cuda requested but no CUDA device is available")
        dtype = (
            DTYPE_NAMES[self.model.dtype]
            if self.model.dtype
            else ("bfloat16" if device.startswith("cuda") else "float32")
        )
        drafter = self.model.drafter
        if default_drafter and self.speculation.method != "ar" and not drafter:
            from .models.builtin import DEFAULT_DRAFTERS

            drafter = DEFAULT_DRAFTERS.get(self.model.id)
            if drafter is None:
                method = self.name("speculation.method")
                raise ConfigError(
                    f"{method} {self.speculation.method} needs {self.name('model.drafter')} (or use {method} ar)"
                )
        return self.replace(model={"device": device, "dtype": dtype, "drafter": drafter})

    @property
    def served_model_name(self) -> str:
        return self.serving.served_model_name or self.model.id

    def serve_batch_sizes(self) -> tuple[list[int], list[int]]:
        """(graph batch buckets, smoke test batch sizes) of `serve` on the resolved device: with graphs,
        every batch size up to max_batch_size has a bucket, and the smoke test covers them all."""
        mbs, buckets = self.serving.max_batch_size, self.kernels.batch_buckets
        if buckets:
            sizes = sorted(set(buckets))
            if max(sizes) > mbs:
                raise ConfigError(
                    f"{self.name('kernels.batch_buckets')} {','.join(map(str, buckets))} exceed "
                    f"{self.name('serving.max_batch_size')} {mbs}"
                )
        else:
            sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= mbs} | {mbs})
        graphs = str(self.model.device).startswith("cuda") and self.kernels.graphs
        graph_buckets = sorted(set(sizes) | {mbs}) if graphs else []
        return graph_buckets, graph_buckets or sizes


def defaults() -> dict[str, Any]:
    """Every field with its default, in the file's layout."""
    return EngineConfig().to_dict()


# flag dest -> config field, per command (the flags not listed here are the command's own)
def _flags(*dests: str) -> dict[str, str]:
    return {d: FLAGS[d] for d in dests}


_MODEL_FLAGS = ("model", "drafter", "device", "dtype", "kernels", "trust_remote_code")
_PARALLEL_FLAGS = ("tensor_parallel", "expert_parallel", "replicate_drafter")
GENERATE_FLAGS = _flags(*_MODEL_FLAGS, "method", "budget", "max_seq_len", *_PARALLEL_FLAGS)
SMOKE_FLAGS = {
    **_flags(*_MODEL_FLAGS, "method", "budget", "max_seq_len", "termination_log", "no_graphs"),
    "batch_sizes": "kernels.batch_buckets",
}
BENCH_FLAGS = _flags(*_MODEL_FLAGS, *_PARALLEL_FLAGS)
