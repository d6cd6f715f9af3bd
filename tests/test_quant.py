"""Quantized weights as published (models/quant.py, models/quant_config.py): INT4 pack-quantized packing,
quantization and dequantization equal compressed-tensors' own (its compressor and helpers are the oracle),
FP8 128x128 blocks equal a plain per-block computation, the quantized linear layers' forwards, their dtypes
through casts, quantize_modules on a meta model loaded with assign=True, and the published configs' parsing."""

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams
from torch import nn

from ddtree.models.quant import (
    Fp8BlockLinear,
    Int4Linear,
    QuantScheme,
    dequantize_fp8_block,
    dequantize_int4,
    pack_int4,
    parse_quantization,
    quantize_fp8_block,
    quantize_int4,
    quantize_modules,
    unpack_int4,
)

CONFIGS = pathlib.Path(__file__).parent / "data" / "model_configs"
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def int4_args(group_size):
    strategy = "channel" if group_size is None else "group"
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy=strategy, group_size=group_size)


def reference_int4(weight, group_size):
    """compressed-tensors' symmetric min-max qparams (its calculate_qparams over each group's min and max, as
    its min-max observer feeds it) and its compressor's packed tensors."""
    args = int4_args(group_size)
    groups = weight.unflatten(-1, (-1, weight.shape[-1] if group_size is None else group_size))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    return packed, scheme, zero_point


def random_weight(rows, cols, dtype, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(rows, cols) * 0.05
    w[1] = 0  # all-zero groups: the scale's eps
    w[2, :8] = torch.tensor([0.05, -0.05, 0.1, -0.1, 0.0, 0.5, -0.5, 0.01])  # the range's ends, -8 and 7
    return w.to(dtype)


# ---- INT4 against compressed-tensors ---------------------------------------------------------------


@pytest.mark.parametrize(
    "group_size, cols, dtype",
    [(32, 256, torch.bfloat16), (128, 384, torch.float32), (None, 200, torch.float16), (None, 100, torch.bfloat16)],
)
def test_int4_matches_compressed_tensors(group_size, cols, dtype):
    weight = random_weight(40, cols, dtype)
    ref, scheme, zero_point = reference_int4(weight, group_size)
    assert ref["weight_shape"].dtype == torch.int64 and ref["weight_shape"].tolist() == [40, cols]
    packed, scale = quantize_int4(weight, group_size)
    assert scale.dtype == dtype and torch.equal(scale, ref["weight_scale"])  # the min-max scale, bit for bit
    assert packed.dtype == torch.int32 and packed.shape == (40, -(-cols // 8))
    assert torch.equal(packed, ref["weight_packed"])
    values = quantize(weight, scale, zero_point, scheme.weights, dtype=torch.int8)
    assert values.min() == -8 and values.max() == 7
    assert torch.equal(pack_int4(values), pack_to_int32(values, 4))
    assert torch.equal(unpack_int4(packed, cols), unpack_from_int32(packed, 4, torch.Size([40, cols])))
    groups = cols if group_size is None else group_size
    expected = PackedQuantizationCompressor.decompress(dict(ref), scheme)["weight"]
    assert torch.equal(dequantize_int4(packed, scale, cols, groups), expected)
    expected32 = dequantize(values, scale, zero_point, scheme.weights, dtype=torch.float32)
    assert torch.equal(dequantize_int4(packed, scale, cols, groups, torch.float32), expected32)


def test_int4_pack_unpack_every_value_and_stacked_experts():
    torch.manual_seed(0)
    values = torch.randint(-8, 8, (3, 5, 77), dtype=torch.int8)  # [experts, out, in], a partial last word
    values[0, 0, :16] = torch.arange(-8, 8, dtype=torch.int8)
    packed = pack_int4(values)
    assert torch.equal(packed, pack_to_int32(values, 4))
    assert torch.equal(unpack_int4(packed, 77), values)
    with pytest.raises(ValueError, match="-8..7"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))


# ---- FP8 blocks -----------------------------------------------------------------------------------


def test_fp8_block_dequantize_equals_per_block_product_with_partial_blocks():
    torch.manual_seed(0)
    weight = (torch.randn(300, 200) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 2) + 0.01  # ceil(300 / 128) x ceil(200 / 128)
    expected = torch.empty(300, 200)
    for i in range(3):
        for j in range(2):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            expected[rows, cols] = weight[rows, cols].float() * scale_inv[i, j].item()
    assert torch.equal(dequantize_fp8_block(weight, scale_inv), expected)
    assert torch.equal(dequantize_fp8_block(weight, scale_inv, dtype=torch.bfloat16), expected.bfloat16())
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8_block(weight, scale_inv[:2])


def test_fp8_block_quantize_round_trip():
    torch.manual_seed(0)
    w = torch.randn(300, 200) * 0.02
    w[:128, :128] = 0  # an all-zero block
    fp8, scale_inv = quantize_fp8_block(w)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (300, 200)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)
    back = dequantize_fp8_block(fp8, scale_inv)
    assert torch.equal(back[:128, :128], torch.zeros(128, 128))
    assert ((back - w).abs() <= w.abs() / 16 + 1e-9).all()  # e4m3: 3 mantissa bits, rounded to nearest


# ---- the linear layers --------------------------------------------------------------------------


def int4_linear(weight, group_size):
    out_features, in_features = weight.shape
    layer = Int4Linear(in_features, out_features, group_size)
    layer.weight_packed, layer.weight_scale = quantize_int4(weight, group_size)
    layer.weight_shape = torch.tensor(weight.shape)
    return layer


def fp8_linear(weight):
    out_features, in_features = weight.shape
    layer = Fp8BlockLinear(in_features, out_features)
    layer.weight, layer.weight_scale_inv = quantize_fp8_block(weight)
    return layer


@pytest.mark.parametrize("kind", ["int4 group 32", "int4 channel", "fp8"])
def test_linear_forward_equals_dequantized_weight(kind):
    torch.manual_seed(0)
    weight, x = torch.randn(160, 192) * 0.05, torch.randn(2, 3, 192)
    if kind == "fp8":
        layer = fp8_linear(weight)
    else:
        layer = int4_linear(weight, 32 if "group" in kind else None)
    dense = layer.dequantize(torch.float32)
    assert torch.equal(layer(x), F.linear(x, dense))
    exact = F.linear(x, weight)
    err = (layer(x) - exact).norm() / exact.norm()
    assert err < (0.05 if kind == "fp8" else 0.15), err
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.bfloat16(), layer.dequantize(torch.bfloat16)))


def test_casts_keep_the_quantized_dtypes():
    torch.manual_seed(0)
    model = nn.ModuleDict({"int4": int4_linear(torch.randn(64, 64), 32), "fp8": fp8_linear(torch.randn(64, 64))})
    fp8, scale_inv = model["fp8"].weight.clone(), model["fp8"].weight_scale_inv.clone()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        model.to(dtype)
        assert model["int4"].weight_packed.dtype == torch.int32 and model["int4"].weight_shape.dtype == torch.int64
        assert model["int4"].weight_scale.dtype == dtype  # the scales follow the model
        assert model["fp8"].weight.dtype == torch.float8_e4m3fn and model["fp8"].weight_scale_inv.dtype == torch.float32
    model.half().float()
    assert torch.equal(model["fp8"].weight.view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(model["fp8"].weight_scale_inv, scale_inv)
    assert set(model.state_dict()) == {
        "int4.weight_packed",
        "int4.weight_scale",
        "int4.weight_shape",
        "fp8.weight",
        "fp8.weight_scale_inv",
    }


# ---- quantize_modules + load_state_dict(assign=True) ------------------------------------------------


def tiny_tree(bias=False) -> nn.Module:
    """Published-style names: attention, routed experts, a dense MLP, the LM head."""
    root = nn.Module()
    root.layers = nn.ModuleList()
    for _ in range(2):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.o_proj = nn.Linear(64, 64, bias=bias)
        layer.mlp = nn.Module()
        layer.mlp.experts = nn.ModuleList(nn.Linear(64, 96, bias=False) for _ in range(2))
        root.layers.append(layer)
    root.lm_head = nn.Linear(64, 16, bias=False)
    return root


def written_state(kind, quantized=("experts",), group_size=32) -> dict:
    """A checkpoint of tiny_tree written by our writers: the `quantized` layers in `kind`, the rest float."""
    torch.manual_seed(0)
    state = {}
    for name, t in tiny_tree().state_dict().items():
        module = name.removesuffix(".weight")
        weight = torch.randn_like(t) * 0.05
        if not any(q in name for q in quantized):
            state[name] = weight
        elif kind == "int4":
            packed, scale = quantize_int4(weight.bfloat16(), group_size)
            state |= {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale}
            state[f"{module}.weight_shape"] = torch.tensor(weight.shape)
        else:
            state[f"{module}.weight"], state[f"{module}.weight_scale_inv"] = quantize_fp8_block(weight)
    return state


@pytest.mark.parametrize("scheme", [QuantScheme("int4", 32), QuantScheme("int4", None), QuantScheme("fp8_block")])
def test_quantize_modules_then_assign_loads_the_published_tensors(scheme):
    kind = "int4" if scheme.kind == "int4" else "fp8"
    state = written_state(kind, ("experts", "self_attn"), scheme.group_size)
    with torch.device("meta"):
        model = tiny_tree()
    quantize_modules(model, scheme, state)
    model.load_state_dict(state, strict=True, assign=True)
    assert not any(t.is_meta for t in model.state_dict().values())
    layer = model.layers[1]
    quantized = Int4Linear if kind == "int4" else Fp8BlockLinear
    assert isinstance(layer.mlp.experts[0], quantized) and isinstance(layer.self_attn.o_proj, quantized)
    assert type(model.lm_head) is nn.Linear
    expert = layer.mlp.experts[1]
    assert (expert.in_features, expert.out_features) == (64, 96)
    if kind == "int4":
        assert expert.group_size == (scheme.group_size or 64)
        assert expert.weight_scale.dtype == torch.bfloat16 and expert.weight_shape.tolist() == [96, 64]
        dense = dequantize_int4(
            state["layers.1.mlp.experts.1.weight_packed"],
            state["layers.1.mlp.experts.1.weight_scale"],
            64,
            expert.group_size,
            torch.float32,
        )
    else:
        assert expert.weight.dtype == torch.float8_e4m3fn and expert.weight_scale_inv.shape == (1, 1)
        dense = dequantize_fp8_block(
            state["layers.1.mlp.experts.1.weight"], state["layers.1.mlp.experts.1.weight_scale_inv"]
        )
    x = torch.randn(5, 64)
    assert torch.equal(expert(x), F.linear(x, dense))
    assert torch.equal(model.lm_head(x), F.linear(x, state["lm_head.weight"]))


def one_line_error(match, call, *args):
    with pytest.raises(ValueError, match=match) as e:
        call(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_quantize_modules_refusals():
    int4, fp8 = written_state("int4"), written_state("fp8")
    int4_scheme, fp8_scheme = QuantScheme("int4", 32), QuantScheme("fp8_block")
    with torch.device("meta"):
        plain = tiny_tree()
    quantize_modules(plain, None, written_state("int4", quantized=()))  # nothing quantized: nothing to do
    quantize_modules(plain, int4_scheme, written_state("int4", quantized=()))
    assert not any(isinstance(m, (Int4Linear, Fp8BlockLinear)) for m in plain.modules())
    first = "layers.0.mlp.experts.0"
    one_line_error(
        rf"'{first}.weight_packed' is quantized but the config has no quantization_config",
        quantize_modules,
        plain,
        None,
        int4,
    )
    one_line_error(
        rf"'{first}.weight_packed' does not belong .*fp8 128x128 block", quantize_modules, plain, fp8_scheme, int4
    )
    one_line_error(
        rf"'{first}.weight_scale_inv' does not belong .*int4 group 32", quantize_modules, plain, int4_scheme, fp8
    )
    zero_point = {**int4, f"{first}.weight_zero_point": torch.zeros(1)}
    one_line_error(rf"'{first}.weight_zero_point' does not belong", quantize_modules, plain, int4_scheme, zero_point)
    stray = {**int4, "layers.0.mlp.gate.weight_packed": torch.zeros(1)}  # no such linear layer
    one_line_error(
        "'layers.0.mlp.gate.weight_packed' is quantized but its module is not a linear layer",
        quantize_modules,
        plain,
        int4_scheme,
        stray,
    )
    with torch.device("meta"):
        biased = tiny_tree(bias=True)
    attn = written_state("int4", quantized=("self_attn",))
    one_line_error("'layers.0.self_attn.o_proj' has a bias", quantize_modules, biased, int4_scheme, attn)
    with torch.device("meta"):
        plain = tiny_tree()
    head = written_state("fp8", quantized=("lm_head",))
    one_line_error(
        "'lm_head.weight_scale_inv': a quantized LM head is not implemented", quantize_modules, plain, fp8_scheme, head
    )


def test_load_refuses_recast_or_reshaped_tensors():
    state = written_state("fp8")
    with torch.device("meta"):
        model = tiny_tree()
    quantize_modules(model, QuantScheme("fp8_block"), state)
    recast = {k: v.bfloat16() if k.endswith("experts.0.weight") else v for k, v in state.items()}
    one_line_error(
        "'layers.0.mlp.experts.0.weight' is torch.bfloat16, not torch.float8_e4m3fn",
        model.load_state_dict,
        recast,
        True,
        True,
    )
    state = written_state("int4")
    with torch.device("meta"):
        model = tiny_tree()
    quantize_modules(model, QuantScheme("int4", 32), state)
    state["layers.0.mlp.experts.0.weight_shape"] = torch.tensor([64, 96])
    one_line_error(r"weight_shape' is \[64, 96\], not \[96, 64\]", model.load_state_dict, state, True, True)


# ---- the configs -------------------------------------------------------------------------------------


def published(name):
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    return raw.get("quantization_config") or raw["text_config"]["quantization_config"]


@pytest.mark.parametrize("name", ["kimi-k2.5", "kimi-k2-thinking", "kimi-k2.6", "deepseek-v3", "kimi-k2-instruct"])
def test_published_configs_parse(name):
    scheme = parse_quantization(published(name))
    if name.startswith("kimi-k2") and name != "kimi-k2-instruct":
        assert (scheme.kind, scheme.group_size, scheme.block) == ("int4", 32, None)
        assert scheme.describe() == "int4 group 32"
        assert list(scheme.ignore) == ([] if name == "kimi-k2.6" else KIMI_IGNORE)  # K2.6's copy: no ignore list
    else:
        assert (scheme.kind, scheme.block) == ("fp8_block", (128, 128)) and scheme.describe() == "fp8 128x128 block"
    assert parse_quantization(None) is None and parse_quantization({}) is None


def test_targets_follow_the_ignore_lists():
    kimi = parse_quantization(published("kimi-k2.5"))
    ignored = [
        "lm_head",
        "model.layers.0.self_attn.q_a_proj",
        "model.layers.5.self_attn.kv_b_proj",
        "model.layers.5.mlp.shared_experts.gate_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.5.mlp.gate",  # the router
    ]
    targeted = ["model.layers.5.mlp.experts.3.gate_proj", "model.layers.5.mlp.experts.3.up_proj"]
    targeted += ["model.layers.60.mlp.experts.383.down_proj"]
    assert not any(kimi.targets(n) for n in ignored) and all(kimi.targets(n) for n in targeted)
    fp8 = parse_quantization(published("deepseek-v3"))
    assert not fp8.targets("lm_head") and not fp8.targets("model.layers.5.mlp.gate")
    assert all(fp8.targets(n) for n in [*targeted, *ignored[1:-1]])
    # DeepSeek-style modules_to_not_convert, as transformers reads it: a regex at the start, or the name's end
    skip = parse_quantization(
        {**published("deepseek-v3"), "modules_to_not_convert": ["model.layers.0.self_attn", "o_proj"]}
    )
    assert not skip.targets("model.layers.0.self_attn.q_a_proj") and not skip.targets("model.layers.7.self_attn.o_proj")
    assert skip.targets("model.layers.7.self_attn.q_a_proj")
    # compressed-tensors targets other than "Linear": names and regexes
    experts_only = {**published("kimi-k2.5"), "ignore": []}
    experts_only["config_groups"]["group_0"]["targets"] = ["re:.*experts.*"]
    only = parse_quantization(experts_only)
    assert only.targets("model.layers.5.mlp.experts.3.gate_proj") and not only.targets("model.layers.5.mlp.down_proj")


def test_channel_and_weight_actorder_parse():
    config = published("kimi-k2.5")
    weights = config["config_groups"]["group_0"]["weights"]
    channel = {**weights, "strategy": "channel", "group_size": None}
    groups = {"group_0": {"targets": ["Linear"], "weights": channel}}
    scheme = parse_quantization({**config, "config_groups": groups})
    assert scheme.kind == "int4" and scheme.group_size is None and scheme.describe() == "int4 channel"
    inferred = {"group_0": {"weights": {"num_bits": 4, "group_size": -1}}}  # strategy from group_size
    assert parse_quantization({**config, "config_groups": inferred}).group_size is None
    static = {"group_0": {"targets": ["Linear"], "weights": {**weights, "actorder": "weight"}}}
    assert parse_quantization({**config, "config_groups": static}).group_size == 32  # columns reordered only
    with pytest.raises(ValueError, match="unknown quantization kind 'int8'"):
        QuantScheme("int8")


def int4_config(**weights):
    base = published("kimi-k2.5")
    group = base["config_groups"]["group_0"]
    return {**base, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}}}


UNSUPPORTED = [
    (
        {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
        "compressed-tensors nvfp4-pack-quantized",
    ),
    (int4_config(symmetric=False), "compressed-tensors pack-quantized int4 asymmetric"),
    (int4_config(num_bits=8), "compressed-tensors pack-quantized int8"),
    (int4_config(actorder="group"), "compressed-tensors pack-quantized int4 actorder group"),
    (int4_config(strategy="tensor", group_size=None), "compressed-tensors pack-quantized int4 strategy tensor"),
    (int4_config(type="float"), "compressed-tensors pack-quantized float4"),
    ({**int4_config(), "format": "float-quantized"}, "compressed-tensors float-quantized"),
    ({**int4_config(), "kv_cache_scheme": {"num_bits": 8}}, "compressed-tensors kv_cache_scheme"),
    ({**int4_config(), "config_groups": {"W4A16": ["Linear"]}}, "compressed-tensors preset scheme 'W4A16'"),
    ({**int4_config(), "quantization_status": "frozen"}, "compressed-tensors quantization_status 'frozen'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq 4-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "gptq 4-bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes 4-bit"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt NVFP4"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fp8 e5m2"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "fp8 static activations"),
    ({"quant_method": "fp8", "weight_block_size": None}, "fp8 per-tensor"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "fp8 64x64 block"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "fp8 ue8m0 scales"),
    ({"quant_method": "hqq", "nbits": 4}, "hqq"),
]


@pytest.mark.parametrize("config, scheme", UNSUPPORTED, ids=[s for _, s in UNSUPPORTED])
def test_unsupported_schemes_are_refused_by_name(config, scheme):
    supported = "(supported: compressed-tensors pack-quantized int4 symmetric, fp8 128x128 block)"
    message = one_line_error("unsupported quantization", parse_quantization, config)
    assert message.startswith(f"unsupported quantization: {scheme}") and message.endswith(supported), message


def test_input_activations_are_refused():
    config = int4_config()
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True}
    one_line_error("compressed-tensors pack-quantized with input activations quantized", parse_quantization, config)
