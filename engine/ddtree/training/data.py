"""Self-distillation data for training a DFlash drafter, built from corpora that exist offline.

Prompts are cut from text that every machine has: the Python standard library (its code, and its
docstrings and comments as prose), optionally other folders (installed packages, /usr/share/doc,
Debian text packages). A share of them is wrapped in the tokenizer's chat template with an
instruction ("Explain this code", "Summarise this text", ...) so that the drafter also sees chat.
The TARGET then continues every prompt (greedy by default), batched; the stored sequence is
prompt + continuation, and only the continuation is supervised, so the drafter learns to predict
the target's own tokens.

File format (one safetensors file plus a JSON manifest next to it):
  tokens       int32 [N]      all sequences, concatenated
  offsets      int64 [S + 1]  sequence s is tokens[offsets[s]:offsets[s + 1]]
  prompt_lens  int32 [S]      the first prompt_lens[s] tokens are prompt (not supervised)
  split        uint8 [S]      0 = train, 1 = held out (held-out prompts come from held-out source files)
  kind         uint8 [S]      index into KINDS
Everything is deterministic given the seed (file order, prompt cuts, split, sampling generator).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import random
import re
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..models.random import ByteTokenizer

KINDS = ("code", "prose", "chat")
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".html", ".htm"}
MAX_FILE_BYTES = 2_000_000

CODE_INSTRUCTIONS = (
    "Explain this code.",
    "What does this code do? Answer briefly.",
    "Write a docstring for this code.",
    "Summarise what this code does in two sentences.",
    "Suggest one improvement to this code.",
    "Rewrite this code with comments.",
    "Are there any bugs in this code?",
    "Write a unit test for this code.",
)
PROSE_INSTRUCTIONS = (
    "Summarise this text.",
    "Explain this in simple terms.",
    "Rewrite this paragraph more concisely.",
    "What are the key points of this text?",
    "Give an example that illustrates this text.",
    "Translate this text into plain English for a beginner.",
)


# ---- corpora --------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without its test suites and the bundled site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__", "lib2to3"}
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return out


def corpus_files(sources: list[str]) -> list[Path]:
    """Resolve corpus sources: "stdlib", "site-packages", or a file / folder of .py and text files.
    Sorted, deduplicated by content, empty and huge files dropped."""
    files: list[Path] = []
    for src in sources:
        if src == "stdlib":
            files.extend(stdlib_files())
            continue
        if src == "site-packages":
            src = sysconfig.get_paths()["purelib"]
        path = Path(src).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(
                    d for d in dirnames if d not in {"__pycache__", "tests", "test"} and not d.startswith(".")
                )
                files.extend(
                    Path(dirpath) / f
                    for f in sorted(filenames)
                    if f.endswith(".py") or Path(f).suffix.lower() in TEXT_SUFFIXES
                )
        else:
            raise FileNotFoundError(f"corpus source '{src}' is neither 'stdlib', 'site-packages' nor a path")
    seen_names: set[Path] = set()
    by_size: dict[int, list[Path]] = {}
    for f in files:
        f = f.resolve()
        if f in seen_names:
            continue
        seen_names.add(f)
        try:
            size = f.stat().st_size
        except OSError:
            continue
        if 200 <= size <= MAX_FILE_BYTES:
            by_size.setdefault(size, []).append(f)
    # content dedup only among files of equal size (cheap: few collisions)
    out = []
    for group in by_size.values():
        if len(group) == 1:
            out.extend(group)
            continue
        digests = set()
        for f in group:
            d = hashlib.sha1(f.read_bytes()).hexdigest()
            if d not in digests:
                digests.add(d)
                out.append(f)
    return sorted(out)


def corpus_names(files: list[Path], sources: list[str]) -> list[str]:
    """Machine-independent names for corpus files, for the manifest: the path below the source the file
    came from, prefixed with that source's label ("stdlib/csv.py", "site-packages/PIL/Image.py",
    "doc/python3/README.txt" for a folder source named doc; a file outside every such folder by its
    name alone). Never an absolute path, so a manifest reads the same on every machine."""
    roots: list[tuple[str, Path]] = [
        ("stdlib", Path(sysconfig.get_paths()["stdlib"]).resolve()),
        ("site-packages", Path(sysconfig.get_paths()["purelib"]).resolve()),
    ]
    for src in sources:
        if src in ("stdlib", "site-packages"):
            continue
        path = Path(src).expanduser().resolve()
        if path.is_dir():
            roots.append((path.name, path))
    roots.sort(key=lambda lr: len(lr[1].parts), reverse=True)  # the innermost source names a file
    names = []
    for f in files:
        f = Path(f).resolve()
        for label, root in roots:
            if f.is_relative_to(root):
                rel = f.relative_to(root).as_posix()
                names.append(f"{label}/{rel}" if label else rel)
                break
        else:
            names.append(f.name)
    return names


def source_label(src: str) -> str:
    """How the manifest names a corpus source: "stdlib", "site-packages", or the file or folder's name."""
    return src if src in ("stdlib", "site-packages") else Path(src).expanduser().resolve().name


_HTML_TAG = re.compile(r"<(script|style)[^>]*>.*?</\1>|<[^>]+>", re.DOTALL | re.IGNORECASE)


@dataclass
class SourceText:
    text: str
    is_code: bool
    prose: list[str] = field(default_factory=list)  # docstrings, comment blocks or paragraphs


def read_source(path: Path) -> SourceText | None:
    try:
        text = path.read_text(encoding="utf-8", errors="ignore")
    except OSError:
        return None
    if path.suffix == ".py":
        return SourceText(text, True, _python_prose(text))
    if path.suffix.lower() in (".html", ".htm"):
        import html

        text = html.unescape(_HTML_TAG.sub(" ", text))
        text = re.sub(r"[ \t]+", " ", text)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) >= 120]
    return SourceText(text, False, paragraphs)


_TRIPLE = re.compile(r'("""|\'\'\')(.*?)\1', re.DOTALL)


def _python_prose(text: str) -> list[str]:
    """Triple-quoted strings (docstrings, mostly) and blocks of consecutive comment lines. Regular
    expressions rather than ast/tokenize: ~20x faster, and a stray non-docstring string is still prose."""
    import inspect

    out = []
    for m in _TRIPLE.finditer(text):
        doc = inspect.cleandoc(m.group(2))
        if len(doc) >= 120:
            out.append(doc)
    block: list[str] = []
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            block.append(stripped.lstrip("#").strip())
            continue
        if block and len(" ".join(block)) >= 120:
            out.append("\n".join(block))
        block = []
    return out


# ---- prompts --------------------------------------------------------------------------------------


@dataclass
class Prompt:
    tokens: list[int]
    kind: int  # index into KINDS
    source: int  # index into the file list
    held_out: bool


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chat(tokenizer, content: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return _encode(tokenizer, f"User: {content}\nAssistant:")


class PromptCutter:
    """Cuts prompts of [min_tokens, max_tokens] tokens out of the corpus files (cached reads)."""

    def __init__(self, files: list[Path], tokenizer, min_tokens: int, max_tokens: int):
        self.files, self.tokenizer = files, tokenizer
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.cache: dict[int, SourceText | None] = {}
        self.weights = [min(f.stat().st_size, 200_000) for f in files]  # favour bigger files, capped
        self._lines_text: str | None = None
        self._lines = [0]  # line starts of the last text (a reference, not an id)
        self._cum: dict[int, tuple[list[int], list[int]]] = {}

    def source(self, i: int) -> SourceText | None:
        if i not in self.cache:
            if len(self.cache) > 32768:
                self.cache.clear()
            self.cache[i] = read_source(self.files[i])
        return self.cache[i]

    def _window(self, rng: random.Random, text: str, n_tokens: int, at_line: bool) -> list[int] | None:
        """n_tokens tokens starting at a random line (or character) of text."""
        if len(text) < 64:
            return None
        chars = n_tokens * 8  # generous: ~3.5 characters per token for code
        if at_line:
            if self._lines_text is not text:
                self._lines_text = text
                self._lines = [0] + [m.end() for m in re.finditer("\n", text)]
            limit = max(1, len(text) - chars // 4)
            hi = bisect.bisect_right(self._lines, limit)
            start = self._lines[rng.randrange(max(1, hi))]
        else:  # prose: start at a word boundary
            start = rng.randrange(0, max(1, len(text) - chars // 4))
            space = text.find(" ", start, start + 40)
            start = space + 1 if start > 0 and space >= 0 else start
        ids = _encode(self.tokenizer, text[start : start + chars])
        return ids[:n_tokens] if len(ids) >= self.min_tokens else None

    def cut(self, rng: random.Random, kind: int, candidates: list[int]) -> tuple[list[int], int] | None:
        key = id(candidates)  # the caller's pools live as long as the cutter is used
        if key not in self._cum or self._cum[key][0] is not candidates:
            self._cum[key] = (candidates, list(itertools.accumulate(self.weights[i] for i in candidates)))
        cum = self._cum[key][1]
        for _ in range(20):
            src_id = rng.choices(candidates, cum_weights=cum)[0]
            src = self.source(src_id)
            if src is None:
                continue
            n = rng.randint(self.min_tokens, self.max_tokens)
            name = KINDS[kind]
            if name == "code":
                if not src.is_code:
                    continue
                ids = self._window(rng, src.text, n, at_line=True)
            elif name == "prose":
                if src.prose:
                    ids = self._window(rng, rng.choice(src.prose), n, at_line=False)
                    # a docstring prefix may be short: accept anything above the minimum
                else:
                    ids = self._window(rng, src.text, n, at_line=False) if not src.is_code else None
            else:  # chat: an instruction about a code window or a prose snippet
                use_code = src.is_code and (not src.prose or rng.random() < 0.6)
                if use_code:
                    snippet = self._window(rng, src.text, n, at_line=True)
                    instr = rng.choice(CODE_INSTRUCTIONS)
                else:
                    pool = src.prose or [src.text]
                    snippet = self._window(rng, rng.choice(pool), n, at_line=False)
                    instr = rng.choice(PROSE_INSTRUCTIONS)
                if snippet is None:
                    continue
                text = self.tokenizer.decode(snippet, skip_special_tokens=True).strip()
                if use_code:
                    content = f"{instr}\n\n```python\n{text}\n```"
                else:
                    content = f"{instr}\n\n{text}"
                ids = _chat(self.tokenizer, content)
            if ids is not None and len(ids) >= self.min_tokens:
                return ids, src_id
        return None


def split_files(n_files: int, held_out_fraction: float, seed: int) -> list[bool]:
    """Per-file held-out flag: held-out prompts never share a source file with training prompts."""
    if held_out_fraction <= 0:
        return [False] * n_files
    if n_files < 2:
        raise ValueError("a held-out split needs at least 2 corpus files")
    order = list(range(n_files))
    random.Random(seed ^ 0x5EED).shuffle(order)
    k = min(n_files - 1, max(1, round(held_out_fraction * n_files)))
    flags = [False] * n_files
    for i in order[:k]:
        flags[i] = True
    return flags


def cut_prompts(
    files: list[Path],
    tokenizer,
    num_prompts: int,
    prompt_tokens: int,
    held_out_fraction: float = 0.05,
    seed: int = 0,
    mix: tuple[float, float, float] = (0.4, 0.2, 0.4),
    min_prompt_tokens: int | None = None,
) -> list[Prompt]:
    """num_prompts prompts (round(held_out_fraction * num_prompts) of them held out), kinds drawn
    with probabilities `mix` (code, prose, chat)."""
    rng = random.Random(seed)
    held = split_files(len(files), held_out_fraction, seed)
    pools = {True: [i for i, h in enumerate(held) if h], False: [i for i, h in enumerate(held) if not h]}
    n_held = round(held_out_fraction * num_prompts) if held_out_fraction > 0 else 0
    cutter = PromptCutter(files, tokenizer, min_prompt_tokens or max(8, prompt_tokens // 4), prompt_tokens)
    prompts: list[Prompt] = []
    for j in range(num_prompts):
        is_held = j >= num_prompts - n_held
        kind = rng.choices(range(len(KINDS)), mix)[0]
        got = cutter.cut(rng, kind, pools[is_held])
        if got is None:  # e.g. no prose in these files: fall back to code, then to anything
            for alt in (0, 1, 2):
                got = cutter.cut(rng, alt, pools[is_held])
                if got is not None:
                    kind = alt
                    break
        if got is None:
            raise ValueError("could not cut prompts from the corpus (files too short?)")
        prompts.append(Prompt(got[0], kind, got[1], is_held))
    return prompts


# ---- the target's continuations ------------------------------------------------------------------


@torch.inference_mode()
def generate_continuations(
    target,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    cuda_graphs: bool = True,
) -> list[list[int]]:
    """The target's continuation of every prompt, cut after the first stop token.

    Plain decoding with the serving engine (`Engine(target, None, "ar")`) on `batch_size` rows, batched
    continuously: waiting prompts join free rows between rounds, prefilled together (prompts sorted by
    length, so that the rows of a round hold similar lengths), and leave them at a stop token or
    max_new_tokens, so each continuation is what `Engine.generate` gives for that prompt. Greedy, or
    sampled (temperature, top_p) from the engine's one generator, seeded with `seed`. On CUDA the rounds
    replay the engine's CUDA graphs (`Engine.capture_graphs`); `cuda_graphs=False`, or a capture that
    fails, decodes eagerly, as on the CPU."""
    from tqdm.auto import tqdm

    from ..runtime.engine import Engine, SamplingParams
    from ..runtime.fused import use_backend

    if not prompts:
        return []
    backend = target.backend  # the Engine swaps fused modules in; training gets the target back as it came
    rows = min(batch_size, len(prompts))
    longest = max(len(p) for p in prompts)
    engine = Engine(target, None, "ar", max_batch_size=rows, max_seq_len=longest + max_new_tokens)
    params = SamplingParams(max_new_tokens, temperature, top_p, stop_token_ids=tuple(stop_token_ids))
    bar = tqdm(total=len(prompts), desc="generating", unit="seq", disable=not progress, dynamic_ncols=True)
    try:
        if cuda_graphs and engine.device.type == "cuda":
            # rounds run on nearly all rows until the queue drains: the tail uses the small buckets
            buckets = sorted({max(1, rows >> k) for k in range(4)})
            try:
                engine.capture_graphs(buckets, sampling=(temperature > 0,))
            except Exception as exc:  # noqa: BLE001 - eager decoding is always correct
                bar.write(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); decoding eagerly")
                engine.graphs = None
                for row in range(rows):
                    engine.release(row)
        engine.generator.manual_seed(seed)
        return _continue_all(engine, prompts, params, bar)
    finally:
        engine.graphs = None  # the graphs refer to the engine: free their memory pool now, not at the next gc
        if target.backend != backend:
            use_backend(target, backend)
        bar.close()


def _continue_all(engine, prompts: list[list[int]], params, bar, prefill_tokens: int = 16384) -> list[list[int]]:
    """Continue every prompt on the engine's rows, batched continuously: between rounds, waiting prompts
    join the lowest free rows (prefilled together, `Engine.add_many`, at most `prefill_tokens` prompt
    tokens a forward) once an eighth of the rows is free, or the rest of the queue fits, or nothing runs
    (a prefill costs about as much as a few rounds); a row is released at its first stop token or
    max_new_tokens."""
    from collections import deque

    waiting = deque(sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i)))  # similar lengths together
    running: dict[int, int] = {}  # engine row -> prompt index
    out: list[list[int]] = [[] for _ in prompts]
    stops = frozenset(params.stop_token_ids)
    rows = engine.max_batch_size
    n_tokens, t0 = 0, time.perf_counter()

    def emit(row: int, toks: list[int]) -> bool:
        """Append a row's new tokens; at a stop token or max_new_tokens, release the row and say so."""
        nonlocal n_tokens
        i = running[row]
        seq = out[i]
        for t in toks:
            seq.append(t)
            if t in stops or len(seq) >= params.max_new_tokens:
                engine.release(row)
                del running[row]
                n_tokens += len(seq) + len(prompts[i])
                return True
        return False

    while waiting or running:
        done = 0
        free = [row for row in range(rows) if row not in running] if waiting else []
        if free and (not running or len(free) >= min(len(waiting), max(1, rows // 8))):
            admit = free[: len(waiting)]
            for row in admit:
                running[row] = waiting.popleft()
            chunk = max(1, prefill_tokens // max(len(prompts[running[row]]) for row in admit))
            for c in range(0, len(admit), chunk):
                group = admit[c : c + chunk]
                firsts = engine.add_many(group, [prompts[running[row]] for row in group], params)
                done += sum(emit(row, [first]) for row, first in zip(group, firsts))
        if running:
            for row, toks in enumerate(engine.step(max(running) + 1)):
                if toks:
                    done += emit(row, toks)
        if done:
            bar.update(done)
            bar.set_postfix(tok_s=f"{n_tokens / max(1e-9, time.perf_counter() - t0):.0f}", refresh=False)
    return out


# ---- the data set ---------------------------------------------------------------------------------


@dataclass
class TokenData:
    tokens: Tensor  # int32 [N]
    offsets: Tensor  # int64 [S + 1]
    prompt_lens: Tensor  # int32 [S]
    split: Tensor  # uint8 [S]
    kind: Tensor  # uint8 [S]
    manifest: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.prompt_lens.shape[0]

    def sequence(self, i: int) -> tuple[Tensor, int]:
        """(tokens [len] int64, prompt length) of sequence i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].long(), int(self.prompt_lens[i])

    def indices(self, held_out: bool) -> Tensor:
        return torch.nonzero(self.split == int(held_out)).flatten()

    def loss_mask(self, i: int) -> Tensor:
        toks, p = self.sequence(i)
        m = torch.zeros(toks.shape[0], dtype=torch.bool)
        m[p:] = True
        return m

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "tokens": self.tokens.int().contiguous(),
            "offsets": self.offsets.long().contiguous(),
            "prompt_lens": self.prompt_lens.int().contiguous(),
            "split": self.split.to(torch.uint8),
            "kind": self.kind.to(torch.uint8),
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"format": "ddtree-train-data", "version": "1"})
        os.replace(tmp, path)
        manifest_path(path).write_text(json.dumps(self.manifest, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> TokenData:
        from safetensors.torch import load_file

        path = Path(path)
        if path.is_dir():
            path = path / "data.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"no training data at {path} (run `ddtree make-data` first)")
        t = load_file(str(path))
        mp = manifest_path(path)
        manifest = json.loads(mp.read_text()) if mp.is_file() else {}
        return cls(t["tokens"], t["offsets"], t["prompt_lens"], t["split"], t["kind"], manifest)

    @classmethod
    def from_sequences(
        cls,
        seqs: list[list[int]],
        prompt_lens: list[int],
        held: list[bool],
        kinds: list[int],
        manifest: dict | None = None,
    ) -> TokenData:
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
        offsets[1:] = lens.cumsum(0)
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
        return cls(
            flat,
            offsets,
            torch.tensor(prompt_lens, dtype=torch.int32),
            torch.tensor(held, dtype=torch.uint8),
            torch.tensor(kinds, dtype=torch.uint8),
            manifest or {},
        )


def manifest_path(data_path: Path) -> Path:
    return data_path.with_name(data_path.stem + ".json")


def make_data(
    target,
    out_path: str | Path,
    tokenizer=None,
    num_prompts: int = 4096,
    prompt_tokens: int = 128,
    continuation_tokens: int = 256,
    held_out_fraction: float = 0.05,
    seed: int = 0,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    batch_size: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    sources: list[str] | None = None,
    mix: tuple[float, float, float] = (0.4, 0.2, 0.4),
    stop_token_ids: tuple[int, ...] | None = None,
    progress: bool = True,
    target_name: str | None = None,
) -> TokenData:
    """Cut prompts from offline corpora, let the target continue them, and save the sequences.

    `target` is a model reference (built-in id, folder, .gguf) or a loaded `Transformer`; with a
    loaded model pass its `tokenizer` (or none: a `ByteTokenizer` is used). Returns the data set,
    also written to `out_path` (+ a JSON manifest next to it)."""
    t0 = time.perf_counter()
    target_id = target if isinstance(target, str) else (target_name or "<in-memory model>")
    if isinstance(target, str):
        from ..runtime.build import device_and_dtype, load_target

        device, dtype = device_and_dtype(device, None if dtype is None else str(dtype).removeprefix("torch."))
        target, loaded_tok = load_target(target_id, device, dtype)
        tokenizer = tokenizer or loaded_tok
    tokenizer = tokenizer or ByteTokenizer(target.config.vocab_size)
    if stop_token_ids is None:
        stops = set(target.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            stops.add(tokenizer.eos_token_id)
        stop_token_ids = tuple(sorted(stops))
    sources = sources or ["stdlib"]
    files = corpus_files(sources)
    if len(files) < 2:
        raise ValueError(f"corpus {sources} has {len(files)} usable files; need at least 2")
    prompts = cut_prompts(files, tokenizer, num_prompts, prompt_tokens, held_out_fraction, seed, mix)
    vocab = target.config.vocab_size
    bad = [t for p in prompts for t in p.tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"tokenizer produced id {bad[0]} outside the target's vocabulary of {vocab}")
    t_cut = time.perf_counter() - t0
    conts = generate_continuations(
        target,
        [p.tokens for p in prompts],
        continuation_tokens,
        stop_token_ids,
        batch_size,
        temperature,
        top_p,
        seed,
        progress,
    )
    keep = [i for i, c in enumerate(conts) if len(c) >= 2]  # a block needs an anchor and one more token
    seqs = [prompts[i].tokens + conts[i] for i in keep]
    data = TokenData.from_sequences(
        seqs,
        [len(prompts[i].tokens) for i in keep],
        [prompts[i].held_out for i in keep],
        [prompts[i].kind for i in keep],
    )
    used = sorted({prompts[i].source for i in keep})
    n_cont = sum(len(conts[i]) for i in keep)
    names = corpus_names(files, sources)  # relative names: the manifest holds no path of this machine
    data.manifest = {
        "format": "ddtree-train-data/1",
        "target": str(target_id),
        "vocab_size": vocab,
        "seed": seed,
        "sources": [source_label(s) for s in sources],
        "num_files": len(files),
        "files": [names[i] for i in used],
        "held_out_files": sorted({names[prompts[i].source] for i in keep if prompts[i].held_out}),
        "num_sequences": len(keep),
        "num_train": int((data.split == 0).sum()),
        "num_held_out": int((data.split == 1).sum()),
        "dropped_short": len(prompts) - len(keep),
        "kinds": {k: int((data.kind == j).sum()) for j, k in enumerate(KINDS)},
        "tokens": int(data.tokens.numel()),
        "continuation_tokens": n_cont,
        "prompt_tokens": prompt_tokens,
        "max_continuation_tokens": continuation_tokens,
        "held_out_fraction": held_out_fraction,
        "temperature": temperature,
        "top_p": top_p,
        "stop_token_ids": list(stop_token_ids),
        "mix": list(mix),
        "batch_size": batch_size,
        "seconds_cutting": round(t_cut, 2),
        "seconds_total": round(time.perf_counter() - t0, 2),
    }
    data.save(out_path)
    return data
