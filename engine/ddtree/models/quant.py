"""Quantized weights as published, the reference path: unpack / dequantize, the writers (for test checkpoints
and random models), and the linear layers that hold the checkpoint's tensors under their published names and
dequantize them in every forward (never the whole model up front). The configs: quant_config.py.

INT4, compressed-tensors `pack-quantized` (symmetric; strategy group or channel):
- `weight_packed` int32 [out, ceil(in/8)]: value i of a row is stored plus 8 (0..15) in bits 4*(i%8) .. +3 of
  word i//8, the first value in the lowest bits (compressed-tensors' pack_to_int32);
- `weight_scale` [out, in/group_size] in the checkpoint's float dtype (bf16 in Kimi's); channel: [out, 1];
- `weight_shape` int64 [2]: (out, in), as compressed-tensors writes it (torch.tensor(weight.shape));
- weight = value * scale of its group, the product rounded to the scale's dtype (compressed-tensors' dequantize).

FP8 block, DeepSeek-V3:
- `weight` float8_e4m3fn [out, in], `weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)];
- weight = fp8.float() * scale_inv of its 128x128 block (the last blocks partial), in fp32 (DeepSeek's
  weight_dequant).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quant_config import FP8_BLOCK, QUANTIZED_TENSOR, QuantScheme, parse_quantization

__all__ = [
    "Fp8BlockLinear",
    "Int4Linear",
    "QuantScheme",
    "dequantize_fp8_block",
    "dequantize_int4",
    "linear_weight",
    "pack_int4",
    "parse_quantization",
    "quantize_fp8_block",
    "quantize_int4",
    "quantize_modules",
    "unpack_int4",
]

FP8_MAX = 448.0  # the largest float8_e4m3fn
_SHIFTS = tuple(range(0, 32, 4))  # bit offsets of the 8 values in an int32 word


def unpack_int4(packed: Tensor, in_features: int) -> Tensor:
    """int32 [..., ceil(in/8)] -> int8 [..., in] in -8..7, as compressed-tensors' unpack_from_int32."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # the mask drops the arithmetic shift's sign bits
    return (nibbles.flatten(-2)[..., :in_features] - 8).to(torch.int8)


def pack_int4(values: Tensor) -> Tensor:
    """int8 [..., in] in -8..7 -> int32 [..., ceil(in/8)], bit for bit compressed-tensors' pack_to_int32 (a
    partial last word is padded with zero bits)."""
    if values.dtype != torch.int8:
        raise ValueError(f"pack_int4 takes int8 values, not {values.dtype}")
    if values.numel() and (values.min() < -8 or values.max() > 7):
        raise ValueError("pack_int4 takes values in -8..7")
    cols = values.shape[-1]
    words = math.ceil(cols / 8)
    unsigned = F.pad(values.to(torch.int64) + 8, (0, words * 8 - cols))
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=values.device)
    word = (unsigned.unflatten(-1, (words, 8)) << shifts).sum(-1)  # 0 .. 2^32 - 1
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, as int32


def dequantize_int4(
    packed: Tensor, scale: Tensor, in_features: int, group_size: int, dtype: torch.dtype | None = None
) -> Tensor:
    """The weight [..., out, in] of an INT4 layer: value * its group's scale, computed in the scale's dtype
    (as compressed-tensors, and the GPU kernels that dequantize to bf16), then cast to `dtype` (default: the
    scale's). group_size: in_features for strategy channel (scale [..., out, 1])."""
    if in_features % group_size or scale.shape[-1] * group_size != in_features:
        raise ValueError(f"scale {tuple(scale.shape)} does not fit {in_features} inputs in groups of {group_size}")
    values = unpack_int4(packed, in_features).unflatten(-1, (in_features // group_size, group_size))
    weight = (values.to(scale.dtype) * scale[..., None]).flatten(-2)
    return weight if dtype is None else weight.to(dtype)


def quantize_int4(weight: Tensor, group_size: int | None) -> tuple[Tensor, Tensor]:
    """(weight_packed, weight_scale) of a float weight [..., out, in], group_size None for strategy channel:
    compressed-tensors' symmetric min-max int4 step for step, in the weight's dtype (scale = max|w| / 7.5 per
    group, eps of the dtype where a group is all zeros; value = round(clamp(w / scale, -8, 7)), half to even)."""
    cols = weight.shape[-1]
    group = cols if group_size is None else group_size
    if cols % group:
        raise ValueError(f"{cols} inputs are not a multiple of group_size {group}")
    groups = weight.unflatten(-1, (cols // group, group))
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
    biggest = torch.maximum(groups.amin(-1).minimum(zero).abs(), groups.amax(-1).maximum(zero))
    scale = biggest / torch.tensor(7.5, dtype=weight.dtype, device=weight.device)  # (7 - (-8)) / 2
    scale = torch.where(scale == 0, torch.finfo(weight.dtype).eps, scale)
    values = torch.round(torch.clamp(groups / scale[..., None], -8, 7)).to(torch.int8).flatten(-2)
    return pack_int4(values), scale


def dequantize_fp8_block(
    weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = FP8_BLOCK, dtype: torch.dtype | None = None
) -> Tensor:
    """The weight [out, in] of an FP8 block layer: fp8 value * its block's scale_inv, computed in fp32, cast to
    `dtype` (default fp32). The last row and column blocks may be partial."""
    rows, cols = weight.shape[-2:]
    if scale_inv.shape[-2:] != (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} in {block}")
    scale = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], -1)[..., :cols]
    out = weight.float() * scale
    return out if dtype is None else out.to(dtype)


def quantize_fp8_block(weight: Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """(weight float8_e4m3fn [out, in], scale_inv fp32 [ceil(out/b0), ceil(in/b1)]) of a float weight: per
    block scale_inv = max|w| / 448, the fp8 value w / scale_inv rounded to nearest (for tests and random
    models: DeepSeek's weights come from FP8 training)."""
    rows, cols = weight.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = F.pad(weight.float(), (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    blocks = padded.view(nr, block[0], nc, block[1])
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    fp8 = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8.view(nr * block[0], nc * block[1])[:rows, :cols].contiguous(), scale_inv


def _check_dtypes(state_dict: dict, prefix: str, dtypes: dict[str, torch.dtype]) -> None:
    for name, dtype in dtypes.items():
        t = state_dict.get(prefix + name)
        if t is not None and t.dtype != dtype:
            raise ValueError(f"checkpoint tensor '{prefix}{name}' is {t.dtype}, not {dtype}")


class Int4Linear(nn.Module):
    """A linear layer (no bias) holding compressed-tensors' INT4 tensors under their published names. Casts of
    the model move `weight_scale` to the model's dtype (torch leaves the integer buffers alone)."""

    weight_packed: Tensor  # buffers, declared for the type checker
    weight_scale: Tensor
    weight_shape: Tensor
    bias: None = None  # as an nn.Linear without one (quantize_modules refuses a quantized layer with a bias)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int | None = None,
        scale_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = in_features if group_size is None else group_size  # channel: one group per row
        if in_features % self.group_size:
            raise ValueError(f"{in_features} inputs are not a multiple of group_size {self.group_size}")
        words, groups = math.ceil(in_features / 8), in_features // self.group_size
        self.register_buffer("weight_packed", torch.empty(out_features, words, dtype=torch.int32, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=scale_dtype, device=device))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], device=device))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _check_dtypes(state_dict, prefix, {"weight_packed": torch.int32})
        shape = state_dict.get(prefix + "weight_shape")
        if shape is not None and not shape.is_meta and shape.tolist() != [self.out_features, self.in_features]:
            raise ValueError(
                f"checkpoint tensor '{prefix}weight_shape' is {shape.tolist()}, not "
                f"[{self.out_features}, {self.in_features}]"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight [out, in] (default dtype: the scale's)."""
        return dequantize_int4(self.weight_packed, self.weight_scale, self.in_features, self.group_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Fp8BlockLinear(nn.Module):
    """A linear layer (no bias) holding DeepSeek's FP8 block tensors under their published names; the fp8
    weight and its fp32 scales keep their dtypes through casts of the model."""

    weight: Tensor  # buffers, declared for the type checker
    weight_scale_inv: Tensor
    bias: None = None  # as an nn.Linear without one

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block: tuple[int, int] = FP8_BLOCK,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block: tuple[int, int] = (block[0], block[1])
        scales = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_inv", torch.empty(scales, dtype=torch.float32, device=device))

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every floating tensor, float8 included: the weight and its scales go through
        # `fn` as raw bytes (an integer view, which casts leave alone), so they move but keep their dtypes
        kept = {name: self._buffers.pop(name) for name in ("weight", "weight_scale_inv")}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            self._buffers[name] = fn(t.view(raw)).view(t.dtype)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a state cast to the run dtype would load silently (assign=True takes the tensor's dtype)
        _check_dtypes(state_dict, prefix, {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight [out, in] (default dtype fp32)."""
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


def linear_weight(module: nn.Module, dtype: torch.dtype) -> Tensor:
    """The [out, in] weight of a linear layer, dequantized if it is a quantized one (for the few places that
    use a weight other than through the layer's forward, as MLA's absorbed kv_b_proj)."""
    if isinstance(module, (Int4Linear, Fp8BlockLinear)):
        return module.dequantize(dtype)
    return cast(nn.Linear, module).weight


# the tensors each kind's layers hold, besides `weight` (fp8)
_TENSORS = {"int4": ("weight_packed", "weight_scale", "weight_shape"), "fp8_block": ("weight_scale_inv",)}
_MARKER = {"int4": "weight_packed", "fp8_block": "weight_scale_inv"}


def quantize_modules(model: nn.Module, scheme: QuantScheme | None, checkpoint_keys: Iterable[str]) -> None:
    """Replace every nn.Linear of `model` (built on the meta device) whose checkpoint holds its quantized
    tensors (`<name>.weight_packed`: int4; `<name>.weight_scale_inv`: fp8 block) by the quantized layer, on
    the linear's device, so that `model.load_state_dict(state, strict=False, assign=True)` then fills it.
    checkpoint_keys are in the model's names. Raises ValueError (one line, naming the first tensor) for
    quantized tensors without a scheme, tensors of another format than the scheme's, and quantized tensors of
    a module that is not a linear layer of the model; a quantized linear layer with a bias is refused."""
    keys = set(checkpoint_keys)
    quantized = sorted(k for k in keys if QUANTIZED_TENSOR.search(k))
    if not quantized:
        return
    if scheme is None:
        raise ValueError(f"checkpoint tensor '{quantized[0]}' is quantized but the config has no quantization_config")
    odd = [k for k in quantized if k.rpartition(".")[2] not in _TENSORS[scheme.kind]]
    if odd:
        raise ValueError(
            f"checkpoint tensor '{odd[0]}' does not belong to the config's quantization ({scheme.describe()}: "
            f"{', '.join(_TENSORS[scheme.kind])})"
        )
    marker, replaced = _MARKER[scheme.kind], set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{name}.{marker}" not in keys:
            continue
        if module.bias is not None:
            raise ValueError(f"linear layer '{name}' has a bias: quantized layers with a bias are not implemented")
        if name == "lm_head":  # the logits, the tied embedding and the vocabulary split read its weight
            raise ValueError(
                f"checkpoint tensor '{name}.{marker}': a quantized LM head is not implemented (published "
                "checkpoints leave it unquantized: their quantization_config ignores lm_head)"
            )
        device = module.weight.device
        new: nn.Module
        if scheme.kind == "int4":
            group_size = scheme.group_size
            if group_size is not None and module.in_features % group_size:
                raise ValueError(f"linear layer '{name}': {module.in_features} inputs are not groups of {group_size}")
            new = Int4Linear(module.in_features, module.out_features, group_size, device=device)
        else:
            new = Fp8BlockLinear(module.in_features, module.out_features, scheme.block, device=device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        replaced.add(name)
    stray = [k for k in quantized if k.rpartition(".")[0] not in replaced]
    if stray:
        raise ValueError(f"checkpoint tensor '{stray[0]}' is quantized but its module is not a linear layer here")
