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


BUDGET_HELP = ("DDTree node budget B (verify width B+1), or one per batch size: 1:32,16:8 runs B=32 for up "
               "to 1 sequence, 8 for up to 16 and beyond; budget 0 decodes without drafting at those batch "
               "sizes (1:32,16:8,64:0; `ddtree bench` prints the measured best); default block_size-1")


def parse_budget(text: str) -> int | dict[int, int]:
    """--budget: an integer, or BATCH:BUDGET pairs (batch sizes should be graph batch buckets)."""
    try:
        if ":" not in text:
            value = int(text)
            if value < 0:
                raise argparse.ArgumentTypeError(f"--budget must be >= 0, got {value}")
            return value
        policy = {int(n): int(b) for n, b in (part.split(":") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget takes an integer or BATCH:BUDGET pairs like 1:32,16:8, got '{text}'")
    if min(policy) < 1 or min(policy.values()) < 0:
        raise argparse.ArgumentTypeError(f"--budget: batch sizes must be >= 1 and budgets >= 0, got '{text}'")
    return policy


def check_budget(args) -> None:
    if isinstance(args.budget, dict) and args.method != "ddtree":
        raise UsageError(f"a budget per batch size needs --method ddtree (got --method {args.method})")


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


# element-wise path of the target: "auto" = the Triton kernels on CUDA when triton is importable
KERNEL_CHOICES = ("auto", "torch", "triton")
DEFAULT_KERNELS = "auto"  # Triton on CUDA when importable (measured faster and lossless in fp32), PyTorch elsewhere


def use_triton_kernels(choice: str, device: str) -> bool:
    from .kernels import available

    if choice == "triton" and not available(device):
        raise UsageError("--kernels triton needs triton and a CUDA device")
    return choice == "triton" or (choice == "auto" and str(device).startswith("cuda") and available(device))


def load_target(ref: str, device: str, dtype, revision: str | None = None, kernels: str = "torch"):
    """(model, tokenizer) for a built-in id, local folder, .gguf file or hub id; `kernels` picks the
    element-wise path (KERNEL_CHOICES)."""
    from transformers import AutoTokenizer

    from .loading import RANDOM_PREFIX, random_model, resolve_model
    from .model import Transformer

    triton = use_triton_kernels(kernels, device)  # refuse before the (slow) load
    if ref.startswith(RANDOM_PREFIX):  # cost runs: random weights and a byte-level stand-in tokenizer
        from .data import ByteTokenizer

        target = random_model(ref.removeprefix(RANDOM_PREFIX), device, dtype)
        if triton:
            target.fuse(kernels=True)
        return target, ByteTokenizer(target.config.vocab_size)
    folder = resolve_model(ref, revision)
    target = Transformer.from_pretrained(folder, dtype=dtype, device=device)
    if triton:
        target.fuse(kernels=True)  # the Engine keeps an already fused target as it is
    return target, AutoTokenizer.from_pretrained(folder)


def target_config(ref: str, revision: str | None = None):
    """The target's ModelConfig without loading weights (a GGUF file is converted first)."""
    from .loading import RANDOM_PREFIX, load_config, random_config, resolve_model
    from .model import ModelConfig

    if ref.startswith(RANDOM_PREFIX):
        return random_config(ref)
    return ModelConfig.from_hf(load_config(resolve_model(ref, revision)))


def load_drafter_ref(ref: str, target, device: str, dtype, revision: str | None = None):
    from .drafter import load_drafter
    from .loading import RANDOM_PREFIX, random_drafter, resolve_model

    if ref.startswith(RANDOM_PREFIX):  # random:LAYERS, a random-init drafter (cost runs)
        layers = ref.removeprefix(RANDOM_PREFIX)
        if not layers.isdigit() or int(layers) < 1:
            raise UsageError(f"a random drafter is random:LAYERS with LAYERS >= 1, got '{ref}'")
        return random_drafter(target, int(layers))
    return load_drafter(resolve_model(ref, revision), target.config, dtype=dtype, device=device)


def stop_ids(tokenizer, target) -> tuple[int, ...]:
    ids = set(target.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def check_parallel_flags(args) -> None:
    import os

    if args.tensor_parallel < 1:
        raise UsageError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.replicate_drafter and args.tensor_parallel == 1 and "WORLD_SIZE" not in os.environ:
        raise UsageError("--replicate-drafter needs --tensor-parallel > 1")


def cmd_generate(args) -> int:
    import os

    check_budget(args)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
    check_parallel_flags(args)
    default_drafter(args)
    device, _ = _device_and_dtype(args.device, args.dtype)
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        from .parallel import init_from_env

        rank, world = init_from_env(device.split(":")[0])
        out = generate_on_rank(rank, world, args)
    elif args.tensor_parallel > 1:  # start the ranks ourselves, once the split is known to fit
        from .parallel import check_divisible, launch

        check_divisible(target_config(args.model), args.tensor_parallel)

        rank, out = 0, launch(args.tensor_parallel, generate_on_rank, args, device_type=device.split(":")[0])
    else:
        rank, out = 0, generate_on_rank(0, 1, args)
    if rank == 0:
        print(json.dumps(out) if args.json else out["text"])
    return 0


def generate_on_rank(rank: int, world: int, args) -> dict:
    """Load, split over `world` ranks when > 1, and generate; every rank computes the same tokens."""
    from .engine import Engine, SamplingParams

    device, dtype = _device_and_dtype(args.device, args.dtype)
    if world > 1 and device == "cuda":
        device = f"cuda:{rank}"
    target, tokenizer = load_target(args.model, device, dtype, kernels=args.kernels if world == 1 else "torch")
    drafter = load_drafter_ref(args.drafter, target, device, dtype) if args.method != "ar" else None
    if world > 1:
        from .parallel import split

        split(target, drafter, rank, world, args.replicate_drafter)
        target.fuse(kernels=use_triton_kernels(args.kernels, device))  # on the shards
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"{args.model}'s tokenizer has no chat template: leave out --chat")
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
    return {
        "text": tokenizer.decode(res.token_ids, skip_special_tokens=True),
        "token_ids": res.token_ids,
        "acceptance_length": round(res.acceptance_length, 4),
        "tokens_per_second": round(res.tokens_per_second, 3),
        "steps": res.rounds,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "method": args.method,
        "budget": engine.budget,
        "tensor_parallel": world,
    }


def default_drafter(args) -> None:
    """Fill --drafter for a built-in target that ships one; otherwise a drafter method needs it."""
    from .loading import DEFAULT_DRAFTERS

    if args.method != "ar" and not args.drafter:
        args.drafter = DEFAULT_DRAFTERS.get(args.model)
        if args.drafter is None:
            raise UsageError(f"--method {args.method} needs --drafter (or use --method ar)")


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} needs positive integers, got '{text}'")
    return values


def build_engine(args, max_batch_size: int):
    """Load target (+ drafter) and build an Engine from the common model flags."""
    from .engine import Engine

    check_budget(args)
    default_drafter(args)
    device, dtype = _device_and_dtype(args.device, args.dtype)
    target, tokenizer = load_target(args.model, device, dtype, kernels=args.kernels)
    drafter = load_drafter_ref(args.drafter, target, device, dtype) if args.method != "ar" else None
    engine = Engine(target, drafter, args.method, args.budget, max_batch_size=max_batch_size,
                    max_seq_len=args.max_seq_len)
    return engine, tokenizer


def cmd_smoke(args) -> int:
    from .smoke import run_smoke, write_termination_log

    sizes = parse_int_list(args.batch_sizes, "--batch-sizes")
    engine, tokenizer = build_engine(args, max(sizes))
    if engine.device.type == "cuda" and not args.no_graphs:
        engine.capture_graphs(batch_buckets=sizes)
    texts = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time", "import numpy as np\n"]
    report = run_smoke(engine, sizes, [tokenizer.encode(t) for t in texts], max_new_tokens=args.max_new_tokens,
                       min_acceptance=args.min_acceptance, fault=args.fault)
    if not report.passed:
        write_termination_log(report.reason, args.termination_log)
    print(report.reason, file=sys.stderr)
    print(json.dumps(report.to_json()))
    return 0 if report.passed else 1


BENCH_PROMPTS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "import json\n\ndef load_config(path):\n",
    "List five tips for writing clear documentation.",
    "def is_prime(n: int) -> bool:\n",
    "What are the main differences between TCP and UDP?",
]


def cmd_bench(args) -> int:
    import os

    device, _ = _device_and_dtype(args.device, args.dtype)
    if device == "cpu" and (args.graphs != "off" or args.capture_all or args.hf_baseline):
        raise UsageError("on CPU, bench runs only with --graphs off and without --capture-all/--hf-baseline")
    from .kernels import available

    if args.kernels == "auto":
        args.kernel_variants = ["triton"] if device.startswith("cuda") and available(device) else ["torch"]
    else:
        args.kernel_variants = ["torch", "triton"] if args.kernels == "both" else [args.kernels]
        if "triton" in args.kernel_variants and not available(device):
            raise UsageError(f"--kernels {args.kernels} needs triton and a CUDA device "
                             "(on CPU only under TRITON_INTERPRET=1, slowly)")
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - {"ar", "dflash", "ddtree"}
    if unknown:
        raise UsageError(f"unknown methods {sorted(unknown)} in --methods")
    args.budgets = parse_int_list(args.budgets, "--budgets")
    args.batch_sizes = parse_int_list(args.batch_sizes, "--batch-sizes")
    args.graph_modes = {"on": [True], "off": [False], "both": [False, True]}[args.graphs]
    check_parallel_flags(args)
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        from .parallel import init_from_env

        bench_on_rank(*init_from_env(device.split(":")[0]), args)
    elif args.tensor_parallel > 1:
        if args.hf_baseline:
            raise UsageError("--hf-baseline runs on one device: leave out --tensor-parallel")
        if device.startswith("cuda") and torch_cuda_count() < args.tensor_parallel:
            raise UsageError(f"--tensor-parallel {args.tensor_parallel} needs {args.tensor_parallel} GPUs, "
                             f"this host has {torch_cuda_count()}")
        from .parallel import check_divisible, launch

        check_divisible(target_config(args.model), args.tensor_parallel)
        launch(args.tensor_parallel, bench_on_rank, args, device_type=device.split(":")[0])
    else:
        bench_on_rank(0, 1, args)
    return 0


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def bench_on_rank(rank: int, world: int, args) -> None:
    """Load (and split over `world` ranks when > 1) and run the benchmark; rank 0 prints and writes."""
    import torch

    from .bench import run_bench

    device, dtype = _device_and_dtype(args.device, args.dtype)
    if world > 1 and device == "cuda":
        device = f"cuda:{rank}"
    target, tokenizer = load_target(args.model, device, dtype)
    if args.model.startswith("random:"):
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.config.vocab_size, (args.ctx,), generator=g).tolist() for _ in range(4)]
        label = f"{args.model} (random weights: acceptance is meaningless, cost only)"
    else:
        prompts = []
        for text in BENCH_PROMPTS:
            if text.startswith(("def ", "class ", "import ")):
                prompts.append(tokenizer.encode(text))
            else:
                prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                             add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
        label = f"{args.model} + {args.drafter or 'no drafter'}"
    drafter = load_drafter_ref(args.drafter, target, device, dtype) if args.drafter else None
    if world > 1:
        from .parallel import split

        how = split(target, drafter, rank, world, args.replicate_drafter)
        label += f", tensor parallel {world} (drafter {how})"
    run_bench(args, target, drafter, prompts, label, report=rank == 0)


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


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="split the target over N processes (one GPU each; gloo on CPU); torchrun works too")
    p.add_argument("--replicate-drafter", action="store_true",
                   help="with --tensor-parallel: run the whole drafter on every rank instead of splitting its "
                        "layers like the target's (the default when its heads divide)")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in id (smollm2-135m-instruct), local folder, .gguf or hub id")
    p.add_argument("--drafter", help="DFlash drafter: local folder, built-in id or hub id")
    p.add_argument("--method", choices=["ar", "dflash", "ddtree"], default="ddtree")
    p.add_argument("--budget", type=parse_budget, help=BUDGET_HELP)
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV cache length per sequence")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", help="float32 / bfloat16 / float16 (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default=DEFAULT_KERNELS,
                   help="element-wise path of the target: PyTorch ops, fused Triton kernels (CUDA), or auto "
                        "(Triton on CUDA when available); default %(default)s")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddtree", description="DDTree speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--model", required=True, help="built-in id (smollm2-135m-instruct), local folder, .gguf or hub id")
    g.add_argument("--drafter", help="DFlash drafter: local folder, built-in id or hub id")
    g.add_argument("--method", choices=["ar", "dflash", "ddtree"], default="ddtree")
    g.add_argument("--budget", type=parse_budget, help=BUDGET_HELP)
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
    g.add_argument("--kernels", choices=KERNEL_CHOICES, default=DEFAULT_KERNELS,
                   help="element-wise path of the target: PyTorch ops, fused Triton kernels (CUDA), or auto "
                        "(Triton on CUDA when available); default %(default)s")
    add_parallel_flags(g)
    g.set_defaults(func=cmd_generate)

    sm = sub.add_parser("smoke", help="capture graphs and compare them with eager execution (readiness gate)")
    add_engine_flags(sm)
    sm.add_argument("--batch-sizes", default="1,2,4")
    sm.add_argument("--max-new-tokens", type=int, default=8)
    sm.add_argument("--min-acceptance", type=float, default=1.0, help="fail below this acceptance length")
    sm.add_argument("--termination-log", help="file for the failure reason (default /dev/termination-log if present)")
    sm.add_argument("--no-graphs", action="store_true", help="compare batched eager rounds only")
    sm.add_argument("--fault", choices=["corrupt-graph-input"], help=argparse.SUPPRESS)
    sm.set_defaults(func=cmd_smoke)

    b = sub.add_parser("bench", help="benchmark ar / dflash / ddtree with and without CUDA graphs")
    b.add_argument("--model", required=True, help="model id, or random:qwen3-8b for random weights of that shape")
    b.add_argument("--drafter", help="drafter id, or random:LAYERS for a random-init drafter")
    b.add_argument("--methods", default="ar,dflash,ddtree")
    b.add_argument("--budgets", default="8,16,32,64,128")
    b.add_argument("--batch-sizes", default="1,4,16,64")
    b.add_argument("--graphs", choices=["on", "off", "both"], default="both")
    b.add_argument("--ctx", type=int, default=1024, help="prompt length for random models")
    add_parallel_flags(b)
    b.add_argument("--rounds", type=int, default=16, help="timed rounds per configuration")
    b.add_argument("--micro", action="store_true", help="also time single target forwards vs the HBM bound")
    b.add_argument("--kernels", choices=[*KERNEL_CHOICES, "both"], default=DEFAULT_KERNELS,
                   help="element-wise path of the target: PyTorch ops, Triton kernels, auto, or both in turn, "
                        "with the logit difference in --micro; default %(default)s")
    b.add_argument("--hf-baseline", action="store_true", help="also time transformers generate")
    b.add_argument("--capture-all", action="store_true", help="also time capturing every batch/span bucket")
    b.add_argument("--device", help="cuda (default when available) or cpu (acceptance and eager speed only)")
    b.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    b.add_argument("--out", help="folder for bench.json and bench.md")
    b.set_defaults(func=cmd_bench)

    from . import server, train

    server.register(sub)
    train.register(sub)

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
    # run the package's module, not this __main__ copy, so that UsageError is one class everywhere
    from ddtree.cli import main as package_main

    sys.exit(package_main())
