"""Give a model folder (config.json, tokenizer) random weights: `python3 benchmarks/random_weights.py FOLDER
[DEVICE]` writes FOLDER/model.safetensors in bf16 from ddtree's random targets (models.random.random_model:
greedy choices with a wide margin, so the smoke test's graphs-against-eager comparison holds, which plain
random initialisation breaks in bf16). For benchmarks of cost that need a model's real tokenizer (the
serving overhead: detokenizing, streaming) without its weights."""

import json
import sys

import torch
from safetensors.torch import save_file

from ddtree.models.random import random_model


def main(folder: str, device: str = "cpu") -> None:
    with open(f"{folder}/config.json") as f:
        hf = json.load(f)
    model = random_model("tiny", device, torch.bfloat16, **hf)  # the folder's config over the tiny shape's keys
    state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    if hf.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})
    print(f"{folder}/model.safetensors: {sum(t.numel() for t in state.values())} parameters")


if __name__ == "__main__":
    main(*sys.argv[1:])
