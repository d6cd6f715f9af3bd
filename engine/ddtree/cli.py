"""The `ddtree` command line."""

from __future__ import annotations

import argparse
import json
import sys


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def _device_and_dtype(device: str | None, dtype: str | None):
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype is None:
        return device, torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in names:
        raise UsageError(f"unknown --dtype '{dtype}' (choose from float32, bfloat16, float16)")
    return device, names[dtype]


def load_target(ref: str, device: str, dtype):
    """(model, tokenizer) for a built-in id, local folder, .gguf file or hub id."""
    from transformers import AutoTokenizer

    from .loading import resolve_model
    from .model import Transformer

    folder = resolve_model(ref)
    return Transformer.from_pretrained(folder, dtype=dtype, device=device), AutoTokenizer.from_pretrained(folder)


def load_drafter_ref(ref: str, target, device: str, dtype):
    from .drafter import load_drafter
    from .loading import resolve_model

    return load_drafter(resolve_model(ref), target.config, dtype=dtype, device=device)


def stop_ids(tokenizer, target) -> tuple[int, ...]:
    ids = set(target.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def cmd_generate(args) -> int:
    from .engine import Engine, SamplingParams

    if args.budget is not None and args.budget < 0:
        raise UsageError(f"--budget must be >= 0, got {args.budget}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.method != "ar" and not args.drafter:
        raise UsageError(f"--method {args.method} needs --drafter (or use --method ar)")
    device, dtype = _device_and_dtype(args.device, args.dtype)
    target, tokenizer = load_target(args.model, device, dtype)
    drafter = load_drafter_ref(args.drafter, target, device, dtype) if args.method != "ar" else None
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    max_seq = args.max_seq_len or len(prompt_ids) + args.max_new_tokens
    engine = Engine(target, drafter, args.method, args.budget, max_batch_size=1, max_seq_len=max_seq)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        stop_token_ids=stop_ids(tokenizer, target),
    )
    (res,) = engine.generate([list(prompt_ids)], params)
    text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": res.token_ids,
            "acceptance_length": round(res.acceptance_length, 4),
            "tokens_per_second": round(res.tokens_per_second, 3),
            "steps": res.rounds,
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "method": args.method,
            "budget": engine.budget,
        }))
    else:
        print(text)
    return 0


def cmd_init_drafter(args) -> int:
    import torch

    from .drafter import DrafterConfig, init_drafter, save_drafter
    from .loading import load_config, resolve_model
    from .model import ModelConfig

    if args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    if args.block_size < 2:
        raise UsageError(f"--block-size must be >= 2, got {args.block_size}")
    target_cfg = ModelConfig.from_hf(load_config(resolve_model(args.target)))
    cfg = DrafterConfig.for_target(
        target_cfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=args.mask_token_id
    )
    cfg.check_target(target_cfg)
    drafter = init_drafter(cfg, seed=args.seed).to(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    out = save_drafter(drafter, args.out)
    print(f"wrote a random-init DFlash drafter ({args.layers} layers, block {args.block_size}, taps "
          f"{cfg.target_layer_ids}) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddtree", description="DDTree speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--model", required=True, help="built-in id (smollm2-135m-instruct), local folder, .gguf or hub id")
    g.add_argument("--drafter", help="DFlash drafter: local folder, built-in id or hub id")
    g.add_argument("--method", choices=["ar", "dflash", "ddtree"], default="ddtree")
    g.add_argument("--budget", type=int, help="DDTree node budget B (verify width B+1); default block_size-1")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-seq-len", type=int, help="KV cache length (default: prompt + max new tokens)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--prompt", required=True)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", help="float32 / bfloat16 / float16 (default: bfloat16 on cuda, float32 on cpu)")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("init-drafter", help="write a randomly initialised DFlash drafter for a target")
    d.add_argument("--target", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--layers", type=int, default=1)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--mask-token-id", type=int, help="vocabulary row used as MASK (default: the last one)")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    d.set_defaults(func=cmd_init_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .drafter import DrafterMismatchError
    from .loading import ModelNotFoundError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UsageError, ModelNotFoundError, DrafterMismatchError, ValueError) as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
