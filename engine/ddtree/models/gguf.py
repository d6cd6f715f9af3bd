"""GGUF files to Hugging Face-layout folders: converted once into the cache, so that the rest of the
engine never sees GGUF."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import tempfile

import numpy as np
import torch


def converted(folder: pathlib.Path) -> bool:
    # Conversions land by an atomic rename, so a folder with both files is complete.
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _metadata(reader) -> dict:
    """GGUF key/values as Python values (token lists excluded: they are large and read separately)."""
    from gguf import GGUFValueType

    meta = {}
    for key, field in reader.fields.items():
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
        ):
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
        meta[key] = value
    return meta


def gguf_to_hf(gguf_path, progress: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Hugging Face config dict, fp32 state dict with Hugging Face names) of a llama/qwen2/qwen3 GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHITECTURES)})"
        )

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{gguf_path}: no token_embd.weight tensor")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    # GGML lists dims fastest-first, so the embedding's ne[1] is the vocabulary (== len(tokenizer.ggml.tokens)).
    vocab = int(tensors["token_embd.weight"].shape[1])
    config = {
        "model_type": arch,
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if "rope_freqs.weight" in tensors:  # llama.cpp stores Llama 3.1-style rope scaling as per-frequency factors
        freqs = dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        config["rope_scaling"] = _llama3_rope_scaling(np.asarray(freqs, np.float64).ravel(), config)

    expected = _hf_shapes(config)
    state = {}
    names = [name for name in tensors if name != "rope_freqs.weight"]
    if progress:
        from tqdm import tqdm

        names = tqdm(names, desc=f"converting {pathlib.Path(gguf_path).name}", unit="tensor")
    for name in names:
        t = tensors[name]
        hf = _hf_name(name)
        if hf not in expected:
            raise ValueError(f"{gguf_path}: unexpected tensor {name} (-> {hf})")
        # t.data is rows x bytes-per-row for quantized types; dequantize gives rows x elements.
        # t.shape is GGML order (fastest dim first), the reverse of torch's.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if array.size != math.prod(shape) or shape != expected[hf]:
            raise ValueError(f"{gguf_path}: {name} has shape {shape}, expected {expected[hf]}")
        if not array.flags.writeable:  # F32/F16 come back as views of the read-only memory map
            array = array.copy()
        w = torch.from_numpy(array.reshape(shape))
        if arch == "llama" and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
            w = _unpermute(w, heads if ".q_proj." in hf else kv_heads)
        state[hf] = w
    optional = {k for k in expected if k.endswith(".bias") or k == "lm_head.weight"}
    if arch != "qwen3":
        optional |= {k for k in expected if k.endswith(("q_norm.weight", "k_norm.weight"))}
    if missing := sorted(set(expected) - optional - set(state)):
        raise ValueError(f"{gguf_path}: missing tensors {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    return config, state


def _hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", stem):
        inner = _LAYER_NAMES.get(m[2], m[2])
        return f"model.layers.{m[1]}.{inner}.{suffix}"
    return f"{_GLOBAL_NAMES.get(stem, stem)}.{suffix}"


def _hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name a GGUF of this config may hold, with its torch shape (optional ones included)."""
    h, d, v, i = config["hidden_size"], config["head_dim"], config["vocab_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.o_proj.bias": (h,),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    return shapes


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for its rotary layout.

    Hugging Face orders each head's rows as [first half | second half] of the rotary pairs; llama.cpp
    interleaves them (row 2j is HF row j, row 2j+1 is HF row j + head_dim/2).
    """
    rest = w.shape[1:]
    return w.reshape(n_head, -1, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
    if (orig := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for key in ("beta_fast", "beta_slow"):
        if (value := meta.get(f"{arch}.rope.scaling.yarn_{key}")) is not None:
            scaling[key] = value
    return scaling


def _llama3_rope_scaling(factors: np.ndarray, config: dict) -> dict:
    """Recover Hugging Face's llama3 rope_scaling from llama.cpp's rope_freqs tensor.

    llama.cpp divides each rotary frequency by factors[i]; the Llama 3.x parameters that produce
    them are factor = max(factors) with low/high frequency factors 1/4 and an 8192 original context.
    Anything else is refused rather than silently run with wrong positions.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(str(np.float32(factors.max()))),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    d, theta = config["head_dim"], config["rope_theta"]
    freqs = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    wavelen = 2 * math.pi / freqs
    old, low, high, factor = 8192, 1.0, 4.0, scaling["factor"]
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    want = 1.0 / ((1 - smooth) / factor + smooth)
    if factors.shape != want.shape or not np.allclose(factors, want, rtol=1e-3):
        raise ValueError("rope_freqs.weight does not match Llama 3 rope scaling; this GGUF is not supported")
    return scaling


def convert_gguf(gguf_path, out_dir, progress: bool = True) -> pathlib.Path:
    """Write config.json, model.safetensors (fp32), generation_config.json and tokenizer files of a GGUF into out_dir.

    The folder is built beside out_dir and renamed into place, so out_dir either is complete or does not exist.
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    config, state = gguf_to_hf(gguf_path, progress=progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared (e.g. a mounted volume)
    try:
        _save_tokenizer(gguf_path, tmp)
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
        with open(tmp / "generation_config.json", "w", encoding="utf-8") as f:
            json.dump(generation, f, indent=2)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not converted(out_dir):  # a non-empty out_dir that is not a finished conversion: leave it alone
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _save_tokenizer(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Save the GGUF's tokenizer as tokenizer.json + tokenizer_config.json (+ chat template)."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{gguf_path}: no tokenizer in the GGUF metadata")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # transformers 5.17 takes eos from bos_token_id for llama GGUFs; set every special token from the ids.
    for attr, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            setattr(tok, attr, tokens.contents(int(token_id)))
    # ...and it ignores add_bos_token (Llama 3 GGUFs need <|begin_of_text|> in front of every prompt).
    for attr in ("add_bos_token", "add_eos_token"):
        if (flag := meta.get(f"tokenizer.ggml.{attr}")) is not None:
            setattr(tok, attr, bool(flag))  # rebuilds the post-processor that tokenizer.json stores
    if meta.get("tokenizer.chat_template"):
        tok.chat_template = meta["tokenizer.chat_template"]
    tok.clean_up_tokenization_spaces = False  # GGUF tokenizers are BPE, where the cleanup corrupts text
    tok.save_pretrained(str(out_dir))
