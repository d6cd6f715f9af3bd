"""A checkpoint's `quantization_config`, parsed without torch (so that a memory planner can read it too): the
two published weight formats the engine loads, and a one-line refusal naming any other scheme.

- compressed-tensors `pack-quantized`, INT4 weight-only, symmetric, strategy `group` (Kimi K2 Thinking, K2.5,
  K2.6: group_size 32) or `channel` (one scale per output row): per linear layer `weight_packed` int32
  [out, in/8], `weight_scale` [out, in/group] and `weight_shape` [2].
- DeepSeek-V3's FP8 (`quant_method: fp8`, e4m3, dynamic activations, `weight_block_size` [128, 128]; also
  Kimi K2 Instruct): per linear layer `weight` float8_e4m3fn [out, in] and `weight_scale_inv` fp32
  [ceil(out/128), ceil(in/128)].

The tensors, their math and the quantized modules are in quant.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED = "compressed-tensors pack-quantized int4 symmetric, fp8 128x128 block"
FP8_BLOCK = (128, 128)

# checkpoint tensors that only a quantized checkpoint holds (compressed-tensors, DeepSeek FP8, GPTQ / AWQ,
# bitsandbytes), by the end of their names
QUANTIZED_TENSOR = re.compile(
    r"(weight_packed|weight_scale|weight_scale_inv|weight_shape|weight_zero_point|weight_g_idx|weight_global_scale"
    r"|input_scale|input_global_scale|input_zero_point|output_scale|k_scale|v_scale|qweight|qzeros|scales|g_idx"
    r"|\.SCB|\.absmax|\.quant_map|\.nested_absmax|\.nested_quant_map|\.quant_state\..*)$"
)
# the MoE routers: DeepSeek-V3's and Kimi's MoEGate is not a Linear (so compressed-tensors' "Linear" target
# skips it, and DeepSeek's FP8 keeps it bf16), and this engine's routers are not linear layers either
ROUTER = re.compile(r"(^|\.)mlp\.gate$")

# compressed-tensors config fields: those that must be empty, and those that change nothing here
_CT_EMPTY = ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config")
_CT_KNOWN = {"quant_method", "config_groups", "format", "ignore", "quantization_status", *_CT_EMPTY}
_CT_KNOWN |= {"global_compression_ratio", "version"}  # informational
# compressed-tensors QuantizationArgs fields (observer*: calibration only; zp_dtype: asymmetric only)
_CT_ARGS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder"}
_CT_ARGS |= {"scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
_FP8_KNOWN = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "dequantize"}
_FP8_KNOWN |= {"modules_to_not_convert", "ignored_layers", "modules_to_convert"}


def unsupported(scheme: str) -> ValueError:
    return ValueError(" ".join(f"unsupported quantization: {scheme} (supported: {SUPPORTED})".split()))


def _match(pattern: str, name: str) -> bool:
    """compressed-tensors' name match: "re:" + a regex matched at the start of the name, or the exact name."""
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else pattern == name


@dataclass(frozen=True)
class QuantScheme:
    kind: str  # "int4" (compressed-tensors pack-quantized) or "fp8_block" (DeepSeek-V3 FP8)
    group_size: int | None = None  # int4: input columns per scale; None: strategy channel (one scale per row)
    block: tuple[int, int] | None = None  # fp8_block: (rows, columns) of weight per scale
    # module names left unquantized, in compressed-tensors' syntax (exact names, or "re:" + a regex matched at
    # the start of the name); DeepSeek's modules_to_not_convert are translated into it
    ignore: tuple[str, ...] = ()
    # compressed-tensors' `targets`: "Linear" (every linear layer), exact names or "re:" regexes
    match: tuple[str, ...] = ("Linear",)

    def __post_init__(self) -> None:
        if self.kind not in ("int4", "fp8_block"):
            raise ValueError(f"unknown quantization kind '{self.kind}' (int4 or fp8_block)")
        if self.kind == "fp8_block" and self.block is None:
            object.__setattr__(self, "block", FP8_BLOCK)

    def targets(self, module_name: str) -> bool:
        """Whether the checkpoint quantizes the linear layer `module_name` (this engine's names, which are the
        published ones): a target and not ignored; never the MoE routers."""
        if ROUTER.search(module_name):
            return False
        matched = any(p == "Linear" or _match(p, module_name) for p in self.match)
        return matched and not any(_match(p, module_name) for p in self.ignore)

    def describe(self) -> str:
        if self.kind == "int4":
            return "int4 " + ("channel" if self.group_size is None else f"group {self.group_size}")
        return f"fp8 {self.block[0]}x{self.block[1]} block"


def split_problem(scheme: QuantScheme, total: int, share: int, dim: int) -> str | None:
    """Why splitting a quantized linear layer's `total` outputs (dim 0) or inputs (dim 1) into shares of `share`
    per rank would cut its scales (None: it would not). INT4 outputs always split (a scale row per output);
    its inputs split on whole scale groups and packed words (a layer with one group a row keeps that scale on
    every rank). FP8 splits where every share starts on a block or lies inside one."""
    if scheme.kind == "fp8_block":
        block = scheme.block[dim]
        if any(r % block and r // block != (r + share - 1) // block for r in range(0, total, share)):
            side = ("outputs", "inputs")[dim]
            return (
                f"{share} of its {total} {side} per rank cut its FP8 scale blocks of {block} "
                f"(each rank's share must be a multiple of {block})"
            )
    elif dim == 1:
        one_group = scheme.group_size in (None, total)
        unit = 8 if one_group else scheme.group_size  # 8 values a packed int32 word
        if share % unit or share % 8:
            what = "words of 8 values" if one_group else f"scale groups of {unit}"
            return (
                f"{share} of its {total} inputs per rank cut its INT4 {what} "
                f"(each rank's share must be a multiple of {unit})"
            )
    return None


def parse_quantization(cfg: dict | None) -> QuantScheme | None:
    """The scheme of a config.json's `quantization_config` (None: not quantized). Anything but the two
    supported formats raises ValueError, one line naming the scheme."""
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(cfg)
    if method == "fp8":
        return _fp8(cfg)
    detail = [str(cfg[k]) for k in ("fmt", "format", "quant_algo") if cfg.get(k)]
    detail += [f"{cfg[k]}-bit" for k in ("bits", "w_bit") if cfg.get(k)]
    detail += [f"{n}-bit" for n in (4, 8) if cfg.get(f"load_in_{n}bit")]
    raise unsupported(" ".join([str(method or "unknown"), *detail]))


def _compressed_tensors(cfg: dict) -> QuantScheme:
    name = "compressed-tensors"
    if cfg.get("format") not in (None, "pack-quantized", "mixed-precision"):  # mixed: per config group
        raise unsupported(f"{name} {cfg['format']}")
    unknown = sorted(set(cfg) - _CT_KNOWN)
    if unknown:
        raise unsupported(f"{name} with config field '{unknown[0]}'")
    for key in _CT_EMPTY:
        if cfg.get(key):
            raise unsupported(f"{name} {key}")
    status = cfg.get("quantization_status", "compressed")  # absent from some copies; the tensors tell
    if status != "compressed":
        raise unsupported(f"{name} quantization_status '{status}' (weights not compressed)")
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise unsupported(f"{name} without config_groups")
    sizes: set[int | None] = set()
    match: list[str] = []
    for group, scheme in groups.items():
        if not isinstance(scheme, dict):  # a preset name ("W4A16": ["Linear"]) with its targets
            raise unsupported(f"{name} preset scheme '{group}'")
        fmt = scheme.get("format") or cfg.get("format")
        if fmt != "pack-quantized":
            raise unsupported(f"{name} {fmt or 'without format'}")
        unknown = sorted(set(scheme) - {"targets", "weights", "input_activations", "output_activations", "format"})
        if unknown:
            raise unsupported(f"{name} {fmt} with group field '{unknown[0]}'")
        for key in ("input_activations", "output_activations"):
            if scheme.get(key):
                raise unsupported(f"{name} {fmt} with {key.replace('_', ' ')} quantized")
        if not scheme.get("weights"):
            raise unsupported(f"{name} {fmt} group '{group}' without weights")
        sizes.add(_int4_group_size(scheme["weights"], f"{name} {fmt}"))
        match += scheme.get("targets") or ["Linear"]
    if len(sizes) > 1:
        shown = ", ".join(sorted("channel" if s is None else f"group {s}" for s in sizes))
        raise unsupported(f"{name} pack-quantized int4 with config groups of different strategies ({shown})")
    return QuantScheme("int4", group_size=sizes.pop(), ignore=tuple(cfg.get("ignore") or ()), match=tuple(match))


def _int4_group_size(args: dict, name: str) -> int | None:
    """group_size of a compressed-tensors QuantizationArgs dict (None: channel), with its defaults (8 bits,
    int, symmetric, the strategy inferred from group_size), or a refusal naming what is not int4 symmetric."""
    unknown = sorted(set(args) - _CT_ARGS)
    if unknown:
        raise unsupported(f"{name} with weights field '{unknown[0]}'")
    kind, bits = str(args.get("type", "int")).lower(), args.get("num_bits", 8)
    if kind != "int" or bits != 4:
        raise unsupported(f"{name} {kind}{bits}")
    if not args.get("symmetric", True):
        raise unsupported(f"{name} int4 asymmetric")
    # actorder "weight" (alias "static") only reorders the columns during calibration: the format is unchanged;
    # "group" (alias "dynamic", or true) stores a permutation (weight_g_idx)
    actorder = args.get("actorder")
    if actorder not in (None, False, "weight", "static"):
        raise unsupported(f"{name} int4 actorder {actorder}")
    if args.get("dynamic", False) is not False:
        raise unsupported(f"{name} int4 dynamic {args['dynamic']}")
    if args.get("scale_dtype") is not None:
        raise unsupported(f"{name} int4 scale_dtype {args['scale_dtype']}")
    group_size = args.get("group_size")
    strategy = args.get("strategy") or {None: "tensor", -1: "channel"}.get(group_size, "group")
    strategy = str(strategy).lower()
    if strategy == "group" and isinstance(group_size, int) and group_size > 0 and not args.get("block_structure"):
        return group_size
    if strategy == "channel" and group_size in (None, -1) and not args.get("block_structure"):
        return None
    raise unsupported(f"{name} int4 strategy {strategy}" + (f" group_size {group_size}" if group_size else ""))


def _fp8(cfg: dict) -> QuantScheme:
    unknown = sorted(set(cfg) - _FP8_KNOWN)
    if unknown:
        raise unsupported(f"fp8 with config field '{unknown[0]}'")
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise unsupported(f"fp8 {cfg['fmt']}")
    if str(cfg.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise unsupported(f"fp8 {cfg['activation_scheme']} activations")
    if cfg.get("scale_fmt", "float") != "float":
        raise unsupported(f"fp8 {cfg['scale_fmt']} scales")
    if cfg.get("modules_to_convert"):
        raise unsupported("fp8 with modules_to_convert (quantized embeddings)")
    block = cfg.get("weight_block_size", list(FP8_BLOCK))  # transformers' default when absent
    if block is None:
        raise unsupported("fp8 per-tensor")
    if tuple(block) != FP8_BLOCK:
        raise unsupported(f"fp8 {'x'.join(map(str, block))} block")
    # transformers' should_convert_module: a pattern matched at the start of the name (a regex), or the end of
    # the name; the LM head stays bf16 (transformers skips the output embedding; DeepSeek-V3 ships it bf16)
    skip = cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or []
    ignore = ["lm_head", *(p for key in skip for p in (f"re:{key}", f"re:.*{re.escape(key)}$"))]
    return QuantScheme("fp8_block", block=FP8_BLOCK, ignore=tuple(ignore))
