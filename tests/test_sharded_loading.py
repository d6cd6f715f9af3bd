"""Sharded loading: under tensor parallelism each rank builds the model on the meta device, cuts it, and
reads only its own slices of the checkpoint (models/checkpoint.SafetensorsFolder), so a rank's host
memory holds its share, not the whole model; and the loaded shards compute what the unsplit model does."""

import pytest
import torch
import torch.distributed as dist
import transformers

from ddtree.models.checkpoint import SafetensorsFolder
from ddtree.models.registry import load_pretrained
from ddtree.runtime.engine import Engine, SamplingParams
from ddtree.runtime.parallel import launch, shard

PROMPT = [3, 14, 15, 92, 65, 35]


def write_checkpoint(folder, layers=6, hidden=768, vocab=32000):
    """A Llama checkpoint of about 370 MB (fp32) in shards of 60 MB with an index, written by
    transformers. initializer_range 0.2 keeps the greedy choices clear of near-ties."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="60MB")


def greedy(target, new_tokens=8):
    engine = Engine(target, None, "ar", None, max_batch_size=1, max_seq_len=64)
    return engine.generate([PROMPT], SamplingParams(max_new_tokens=new_tokens))[0].token_ids


def resident() -> tuple[int, int]:
    """(resident bytes now, peak since the last reset_peak())."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: the peak resident size starts again from the current one


def load_rank(rank, world, folder, warm_up):
    torch.set_num_threads(1)
    # the first load also initialises torch's operators (tens of MB); measure the second
    load_pretrained(warm_up, torch.float32, "cpu", shard=lambda m: shard(m, rank, world))
    before, _ = resident()
    reset_peak()
    target = load_pretrained(folder, torch.float32, "cpu", shard=lambda m: shard(m, rank, world))
    grown = resident()[1] - before
    share = sum(t.nbytes for t in target.state_dict().values())
    every = [None] * world
    dist.all_gather_object(every, (grown, share, greedy(target)))
    return every


@pytest.mark.slow  # writes a 370 MB checkpoint and reads it three times: about 20 s on 2 cores
def test_each_rank_reads_only_its_share_and_the_split_equals_the_whole(tmp_path):
    try:
        reset_peak()
    except OSError as exc:
        pytest.skip(f"cannot reset the peak resident size here: {exc}")
    write_checkpoint(tmp_path / "model")
    write_checkpoint(tmp_path / "warm-up", layers=1, hidden=96, vocab=1000)
    stored = SafetensorsFolder(tmp_path / "model")
    total = sum(t.nbytes for t in stored.tensors.values())
    assert len({t.file for t in stored.tensors.values()}) > 3 and total > 300e6
    expected = greedy(load_pretrained(tmp_path / "model", torch.float32, "cpu"))
    for grown, share, tokens in launch(2, load_rank, tmp_path / "model", tmp_path / "warm-up"):
        assert tokens == expected
        assert share < 0.55 * total  # half of everything but the norms
        # the peak grows by the rank's share (plus reading buffers), not by the whole checkpoint
        assert grown < 1.15 * share + 16e6, (grown, share, total)


def test_a_slice_reads_the_rows_or_columns_asked_for(tmp_path):
    from safetensors.torch import save_file

    tensors = {
        "w": torch.randn(300, 70),
        "wide": torch.randn(4, 1 << 19),  # a column slice of 1 MiB per row: read row by row
        "b": torch.randn(5).bfloat16(),
        "q": torch.randn(64, 128).to(torch.float8_e4m3fn),
        "i": torch.randint(0, 9, (10, 4), dtype=torch.int32),
        "s": torch.tensor(3.0),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    stored = SafetensorsFolder(tmp_path)
    for name, t in tensors.items():
        read = stored.read(name)
        raw = read.reshape(-1).view(torch.uint8)
        assert read.dtype == t.dtype and torch.equal(raw, t.reshape(-1).view(torch.uint8))
    assert torch.equal(stored.read("w", (0, 100, 100)), tensors["w"][100:200])
    assert torch.equal(stored.read("w", (1, 35, 35)), tensors["w"][:, 35:])
    assert torch.equal(stored.read("wide", (1, 1 << 18, 1 << 18)), tensors["wide"][:, 1 << 18 :])
    assert torch.equal(stored.read("q", (1, 64, 64)).view(torch.uint8), tensors["q"][:, 64:].view(torch.uint8))
