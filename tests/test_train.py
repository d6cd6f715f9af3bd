"""Drafter training: self-distillation data, the cache-free training forward (== inference), loss goes
down, the saved drafter is lossless in the engine, resume is exact, mismatches are refused, CLI."""

import copy
import json

import pytest
import torch

from ddtree.models.llama import ModelConfig, Transformer
from ddtree.models.random import ByteTokenizer
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.speculative.drafter import DrafterConfig, DrafterMismatchError, init_drafter, save_drafter
from ddtree.speculative.loading import load_drafter
from ddtree.training.data import (
    TokenData,
    corpus_files,
    cut_prompts,
    generate_continuations,
    make_data,
    stdlib_files,
)
from ddtree.training.loop import evaluate, find_checkpoint, lr_at, train_drafter
from ddtree.training.recipe import (
    Sampler,
    TrainConfig,
    block_hidden,
    build_batch,
    copy_target_layers,
    make_drafter_config,
    target_features,
)

FILES = [str(p) for p in stdlib_files()[:12]]


def other_target(vocab: int) -> Transformer:
    """A tiny random target of another vocabulary (no `from conftest import`: tests/operator has a
    conftest.py of its own, and the two would shadow each other)."""
    torch.manual_seed(1)
    model = Transformer(
        ModelConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.eval()


def small_cfg(**kw) -> TrainConfig:
    base = {
        "layers": 1,
        "block_size": 8,
        "batch_size": 8,
        "anchors_per_seq": 8,
        "steps": 30,
        "lr": 3e-3,
        "eval_every": 0,
        "log_every": 5,
        "save_every": 0,
        "final_eval_prompts": 0,
    }
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def target(tiny_target):
    return copy.deepcopy(tiny_target)  # conftest's random_target(); own copy: training rewrites its KV cache


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.safetensors"
    return make_data(
        target,
        path,
        num_prompts=24,
        prompt_tokens=32,
        continuation_tokens=40,
        held_out_fraction=0.25,
        sources=FILES,
        batch_size=12,
        seed=0,
        progress=False,
    ), path


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    cfg = small_cfg(final_eval_prompts=4, final_eval_tokens=24, final_eval_budget=8, eval_every=15)
    res = train_drafter(target, data[0], out, cfg, progress=False, target_name="tiny", data_path=str(data[1]))
    return res, cfg


def test_make_data_format_split_and_determinism(target, data):
    d, path = data
    m = json.loads(path.with_name("data.json").read_text())
    assert m["num_sequences"] == len(d) == m["num_train"] + m["num_held_out"] and m["num_held_out"] == 6
    assert m["seed"] == 0 and m["vocab_size"] == 64 and set(m["kinds"]) == {"code", "prose", "chat"}
    assert m["tokens"] == d.tokens.numel() == int(d.offsets[-1])
    held = set(m["held_out_files"])
    assert held and held.isdisjoint(set(m["files"]) - held)  # the split is by source file
    # files are named below their source, never by an absolute path of the machine that made the data
    assert all(name.startswith("stdlib/") for name in m["files"] + m["held_out_files"])
    assert not any(src.startswith("/") for src in m["sources"])
    loaded = TokenData.load(path)
    assert torch.equal(loaded.tokens, d.tokens) and torch.equal(loaded.split, d.split)
    toks, p = loaded.sequence(0)
    mask = loaded.loss_mask(0)
    assert mask.sum() == toks.shape[0] - p >= 2 and not mask[:p].any()
    # deterministic given the seed: the same prompts and (greedy) continuations again
    tok = ByteTokenizer(64)
    a = cut_prompts(corpus_files(FILES), tok, 24, 32, 0.25, seed=0)
    assert [x.tokens for x in a] == [loaded.sequence(i)[0][: loaded.sequence(i)[1]].tolist() for i in range(24)]
    b = cut_prompts(corpus_files(FILES), tok, 24, 32, 0.25, seed=1)
    assert [x.tokens for x in a] != [x.tokens for x in b]


def test_batched_generation_equals_engine_ar(target):
    """Continuations of prompts of different lengths, 3 rows for 5 prompts: plain greedy decoding, cut
    after the first stop token; sampled ones depend on the seed alone."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 31)), [5] * 12, [40, 41]]
    for stops in [(), (3, 17)]:
        got = generate_continuations(target, prompts, 20, stops, batch_size=3, progress=False)
        eng = Engine(target, None, "ar", max_batch_size=len(prompts), max_seq_len=64)
        ref = eng.generate(prompts, SamplingParams(max_new_tokens=20, stop_token_ids=stops))
        assert got == [r.token_ids for r in ref]
    sampled = [
        generate_continuations(target, prompts, 20, (3,), 3, temperature=1.0, top_p=0.9, seed=s, progress=False)
        for s in (0, 0, 1)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    for seq in sampled[0]:
        assert 1 <= len(seq) <= 20 and (len(seq) == 20 or seq[-1] == 3) and 3 not in seq[:-1]


def test_training_forward_equals_inference_forward(target, data):
    """Per anchor, the cache-free training path gives the logits of append_context + forward with
    the drafter cache (as Engine.add / Engine.propose), within fp32 tolerance."""
    cfg = small_cfg(layers=2, anchors_per_seq=5, batch_size=4)
    drafter = init_drafter(make_drafter_config(target.config, cfg), seed=1)
    with torch.no_grad():  # non-trivial norms, so that a mix-up of q/k norms would show
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * 0.3)
    batch = Sampler(data[0], cfg).train_batch(0)
    assert batch.lengths.min() < batch.tokens.shape[1]  # right padding is present
    BS = cfg.block_size
    with torch.no_grad():
        feats = target_features(target, batch.tokens, drafter.config.target_layer_ids)
        train_logits = target.lm_head(block_hidden(drafter, target, feats, batch.tokens, batch.anchors)[:, :, 1:])
        checked = 0
        for b in range(batch.tokens.shape[0]):
            for i in range(batch.anchors.shape[1]):
                a = int(batch.anchors[b, i])
                drafter.setup_caches(1, 256)
                j = torch.arange(a)[None]
                drafter.append_context(feats[b : b + 1, :a], j, j)  # context = positions < anchor
                block = torch.full((1, BS), drafter.config.mask_token_id)
                block[0, 0] = batch.tokens[b, a]  # the bonus token sits at the anchor
                pos = a + torch.arange(BS)[None]
                mask = (torch.arange(256) < a + BS).view(1, 1, 1, 256).expand(1, 1, BS, 256)
                ref = target.lm_head(drafter(target.embed(block), pos, pos, mask)[:, 1:])
                torch.testing.assert_close(train_logits[b, i], ref[0], atol=2e-4, rtol=1e-4)
                checked += 1
    assert checked == 20


def test_loss_weights_and_schedule():
    from ddtree.training.recipe import position_weights

    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0 and abs(float(w[7]) - float(torch.exp(torch.tensor(-1.0)))) < 1e-6
    cfg = TrainConfig(steps=100, warmup=0.1, lr=1e-3)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) < 1e-5 and lr_at(50, cfg) < lr_at(20, cfg)


def test_anchors_supervise_continuation_only(data):
    d = data[0]
    batch = build_batch(d, list(range(6)), 8, 8, 1024, torch.Generator().manual_seed(0))
    for b in range(6):
        _, p = d.sequence(b)
        a = batch.anchors[b][batch.anchor_valid[b]]
        assert (a >= p).all() and (a + 1 < batch.lengths[b]).all()
        for i in range(8):
            for k in range(7):
                pos = int(batch.anchors[b, i]) + k + 1
                if batch.label_mask[b, i, k]:
                    assert pos < batch.lengths[b] and batch.labels[b, i, k] == batch.tokens[b, pos]


def test_training_lowers_the_loss(target, data, trained):
    """Held-out-style check on one fixed training batch: the loss after training must be clearly
    below the loss of the same drafter's initial weights."""
    res, cfg = trained
    fixed = [Sampler(data[0], cfg).train_batch(0)]
    init = init_drafter(make_drafter_config(target.config, cfg), seed=cfg.seed)
    before = evaluate(init, target, fixed, cfg.gamma, "cpu", False)["loss"]
    after_drafter = load_drafter(res.out_dir / "checkpoint", target.config)
    after = evaluate(after_drafter, target, fixed, cfg.gamma, "cpu", False)["loss"]
    assert after < 0.6 * before, (before, after)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_init_from_target_copies_layers_and_trains(target, data, tmp_path):
    """--init-from-target: drafter layer i starts as target layer ids[i] (attention, MLP, norms) and
    `fc` as the identity on the deepest tap; training from there still lowers the loss."""
    cfg = small_cfg(layers=2, steps=10, init_from_target=[2, 3])
    drafter = init_drafter(make_drafter_config(target.config, cfg), seed=0)
    copy_target_layers(drafter, target, [2, 3])
    for d_layer, i in zip(drafter.layers, [2, 3]):
        for name, p in target.model.layers[i].state_dict().items():
            assert torch.equal(d_layer.state_dict()[name], p), name
    h = target.config.hidden_size
    assert torch.equal(drafter.fc.weight[:, -h:], torch.eye(h)) and not drafter.fc.weight[:, :-h].any()
    with pytest.raises(ValueError, match="2 drafter layers"):
        copy_target_layers(drafter, target, [3])
    res = train_drafter(target, data[0], tmp_path, cfg, progress=False)
    assert sum(res.losses[-3:]) < sum(res.losses[:3])
    assert "initialised from target layers [2, 3]" in (tmp_path / "README.md").read_text()


def test_saved_drafter_loads_and_decodes_losslessly(target, data, trained):
    res, _ = trained
    out = res.out_dir
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["block_size"] == 8
    drafter = load_drafter(out, target.config, dtype=torch.float32)
    d = data[0]
    prompts = [d.sequence(i)[0][: d.sequence(i)[1]].tolist() for i in d.indices(held_out=True)[:3].tolist()]
    sp = SamplingParams(max_new_tokens=24)
    ref = Engine(target, None, "ar", max_batch_size=3, max_seq_len=160).generate(prompts, sp)
    for method, budget in [("dflash", None), ("ddtree", 8)]:
        got = Engine(target, drafter, method, budget, max_batch_size=3, max_seq_len=160).generate(prompts, sp)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    card = (out / "README.md").read_text()
    assert "held-out acceptance estimate" in card and "ddtree_b8" in card
    assert res.final_eval["ddtree_b8"]["same_as_ar"] == 1.0 and res.final_eval["dflash"]["acceptance_length"] >= 1
    events = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "start" and events[-1]["event"] == "end"
    assert not events[0]["data_path"].startswith("/") and f"`{events[0]['data_path']}`" in card
    assert any(e.get("event") == "eval" and e["step"] == 15 for e in events)


def test_resume_reproduces_an_uninterrupted_run(target, data, tmp_path):
    cfg = small_cfg(steps=6, save_every=0)
    full = train_drafter(target, data[0], tmp_path / "full", cfg, progress=False, final_eval=False)
    part = train_drafter(target, data[0], tmp_path / "part", cfg, progress=False, until_step=3)
    assert part.stopped == "until" and part.step == 3
    assert json.loads((find_checkpoint(tmp_path / "part") / "trainer_state.json").read_text())["step"] == 3
    rest = train_drafter(
        target, data[0], tmp_path / "part", cfg, resume=tmp_path / "part", progress=False, final_eval=False
    )
    assert rest.step == 6
    torch.testing.assert_close(torch.tensor(part.losses + rest.losses), torch.tensor(full.losses), rtol=1e-5, atol=1e-6)
    a = load_drafter(tmp_path / "full" / "checkpoint").state_dict()
    b = load_drafter(tmp_path / "part" / "checkpoint").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_mismatched_drafter_or_data_is_refused(target, data, tmp_path):
    other = ModelConfig(
        vocab_size=500,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    save_drafter(init_drafter(DrafterConfig.for_target(other, target_layer_ids=[1])), tmp_path / "other")
    with pytest.raises(DrafterMismatchError, match="vocabulary 500 != target's 64"):
        train_drafter(target, data[0], tmp_path / "o1", small_cfg(steps=1), init=tmp_path / "other", progress=False)
    # a checkpoint made for another target
    big = other_target(vocab=80)
    small = TokenData.from_sequences(
        [[1, 2, 3, 4, 5, 6]] * 4, [2] * 4, [False, False, False, True], [0] * 4, {"vocab_size": 80}
    )
    train_drafter(big, small, tmp_path / "big", small_cfg(steps=1, batch_size=2), progress=False, final_eval=False)
    with pytest.raises(DrafterMismatchError, match="vocabulary 80 != target's 64"):
        train_drafter(target, data[0], tmp_path / "big", resume=tmp_path / "big", progress=False)
    # data made with another vocabulary
    with pytest.raises(ValueError, match="vocabulary of 80"):
        train_drafter(target, small, tmp_path / "o2", small_cfg(steps=1), progress=False)


def _tiny_hf_folder(target, folder):
    """The tiny target as a HF folder with a character-level tokenizer (ids < 63)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    c = target.config
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_hidden_layers,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": c.rope_theta,
                "tie_word_embeddings": True,
                "eos_token_id": 1,
            }
        )
    )
    state = {k: v.contiguous() for k, v in target.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    chars = "\n abcdefghijklmnopqrstuvwxyz0123456789()[]:=.,_'\"#+-*/<>"
    vocab = {"<unk>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    assert max(vocab.values()) < 63
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)


def test_cli_make_data_train_and_resume(target, tmp_path, capsys):
    from ddtree import cli
    from ddtree.config import UsageError

    folder = tmp_path / "tiny"
    _tiny_hf_folder(target, folder)

    def run(*argv):
        return cli.run(list(argv))

    base = ["--target", str(folder), "--device", "cpu"]
    assert (
        run(
            "make-data",
            *base,
            "--out",
            str(tmp_path / "d"),
            "--num-prompts",
            "12",
            "--prompt-tokens",
            "24",
            "--continuation-tokens",
            "24",
            "--held-out",
            "0.25",
            "--batch-size",
            "6",
            "--source",
            FILES[0],
            "--source",
            FILES[4],
            "--source",
            FILES[10],
        )
        == 0
    )
    assert (tmp_path / "d" / "data.safetensors").is_file()
    train = [
        "train-drafter",
        *base,
        "--out",
        str(tmp_path / "dr"),
        "--data",
        str(tmp_path / "d"),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--batch-size",
        "4",
        "--anchors-per-seq",
        "4",
        "--steps",
        "4",
        "--no-progress",
        "--final-eval-prompts",
        "2",
        "--final-eval-tokens",
        "8",
        "--final-eval-budget",
        "4",
        "--taps",
        "1,2",
    ]
    assert run(*train) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 4 and summary["acceptance"]["ddtree_b4"]["same_as_ar"] == 1.0
    assert json.loads((tmp_path / "dr" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 2]
    assert "ddtree train-drafter" in (tmp_path / "dr" / "README.md").read_text()
    assert run(*train[:-8], "--final-eval-prompts", "0", "--steps", "6", "--resume", str(tmp_path / "dr")) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 6
    # resuming without --steps keeps the checkpoint's step count (6), not the flag's default; without
    # --data it uses the checkpoint's data
    no_data = [a for i, a in enumerate(train[:-8]) if a != "--data" and train[i - 1] != "--data"]
    assert run(*no_data, "--final-eval-prompts", "0", "--resume", str(tmp_path / "dr")) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 6
    for bad, needle in [
        (["--block-size", "1"], "--block-size"),
        (["--resume", "x", "--init", "y"], "exclude"),
        (["--taps", "1,9"], "outside the target"),
        (["--taps", "a"], "integers"),
        (["--init-from-target", "1,2,3"], "needs 2 target layer"),
        (["--init-from-target", "--resume", "x"], "excludes"),
    ]:
        with pytest.raises(UsageError, match=needle):
            run("train-drafter", *base, "--out", str(tmp_path / "e"), "--data", str(tmp_path / "d"), *bad)
    with pytest.raises(UsageError, match="make-data"):
        run("train-drafter", *base, "--out", str(tmp_path / "e"), "--data", str(tmp_path / "nodata"))
    with pytest.raises(UsageError, match="no training checkpoint"):
        run(
            "train-drafter",
            *base,
            "--out",
            str(tmp_path / "e"),
            "--data",
            str(tmp_path / "d"),
            "--resume",
            str(tmp_path / "nowhere"),
        )
    with pytest.raises(UsageError, match="corpus source"):
        run("make-data", *base, "--out", str(tmp_path / "e"), "--source", str(tmp_path / "nowhere"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_generation_and_bf16_training(target, data, tmp_path):
    """On CUDA: generation whose rounds replay the engine's CUDA graphs emits the eager tokens (fp32), and
    bf16 autocast training lowers the loss."""
    gpu = Transformer(target.config)  # a fresh, unfused copy: Engine fuses q/k/v in place, which .to() breaks
    gpu.load_state_dict(target.state_dict())
    gpu = gpu.cuda().eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 31)), [5] * 12, [40, 41]]
    eager = generate_continuations(gpu, prompts, 24, (3,), batch_size=3, progress=False, cuda_graphs=False)
    graphed = generate_continuations(gpu, prompts, 24, (3,), batch_size=3, progress=False, cuda_graphs=True)
    assert graphed == eager
    res = train_drafter(
        gpu.to(torch.bfloat16),
        data[0],
        tmp_path / "gpu",
        small_cfg(steps=30),
        device="cuda",
        progress=False,
        final_eval=False,
    )
    assert sum(res.losses[-5:]) < 0.6 * sum(res.losses[:5])
    assert load_drafter(tmp_path / "gpu", target.config).fc.weight.dtype == torch.bfloat16


@pytest.mark.slow
def test_smollm2_one_layer_drafter_trains(smollm2, tmp_path):
    """~30 CPU steps of a 1-layer drafter on SmolLM2 self-distilled data: loss goes down, the saved
    drafter is lossless in the engine."""
    model, tok, _ = smollm2
    data = make_data(
        model,
        tmp_path / "data.safetensors",
        tokenizer=tok,
        num_prompts=16,
        prompt_tokens=48,
        continuation_tokens=40,
        held_out_fraction=0.25,
        batch_size=16,
        progress=False,
        sources=[str(p) for p in stdlib_files()[:40]],
    )
    cfg = TrainConfig(
        layers=1,
        block_size=16,
        batch_size=4,
        anchors_per_seq=8,
        steps=30,
        lr=1e-3,
        eval_every=0,
        save_every=0,
        log_every=5,
        final_eval_prompts=2,
        final_eval_tokens=24,
        final_eval_budget=16,
    )
    res = train_drafter(model, data, tmp_path / "out", cfg, progress=False)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert res.final_eval["ddtree_b16"]["same_as_ar"] == 1.0 and res.final_eval["dflash"]["same_as_ar"] == 1.0
