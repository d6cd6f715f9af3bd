"""The `ddtree` command line."""

from __future__ import annotations

import argparse
import json
import sys

from .build import stop_ids, target_config
from .config import (
    DEFAULT_SMOKE_BUCKETS,
    FLAGS,
    KERNEL_CHOICES,
    EngineConfig,
    KernelConfig,
    parse_int_list,
)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


BUDGET_HELP = (
    "DDTree node budget B (verify width B+1), or one per batch size: 1:32,16:8 runs B=32 for up "
    "to 1 sequence, 8 for up to 16 and beyond; budget 0 decodes without drafting at those batch "
    "sizes (1:32,16:8,64:0; `ddtree bench` prints the measured best); default block_size-1"
)


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
        raise argparse.ArgumentTypeError(
            f"--budget takes an integer or BATCH:BUDGET pairs like 1:32,16:8, got '{text}'"
        ) from None
    if min(policy) < 1 or min(policy.values()) < 0:
        raise argparse.ArgumentTypeError(f"--budget: batch sizes must be >= 1 and budgets >= 0, got '{text}'")
    return policy


# element-wise path of the target: "auto" = the Triton kernels on CUDA when triton is importable
DEFAULT_KERNELS = KernelConfig.backend  # Triton on CUDA when importable (measured faster and lossless in fp32)


# flag dest -> config field, per command (the flags not listed here are the command's own)
def _flags(*dests: str) -> dict[str, str]:
    return {d: FLAGS[d] for d in dests}


_MODEL_FLAGS = ("model", "drafter", "device", "dtype", "kernels")
GENERATE_FLAGS = _flags(*_MODEL_FLAGS, "method", "budget", "max_seq_len", "tensor_parallel", "replicate_drafter")
SMOKE_FLAGS = {
    **_flags(*_MODEL_FLAGS, "method", "budget", "max_seq_len", "termination_log", "no_graphs"),
    "batch_sizes": "kernels.batch_buckets",
}
BENCH_FLAGS = _flags(*_MODEL_FLAGS, "tensor_parallel", "replicate_drafter")


def cmd_generate(args) -> int:
    import os

    config = EngineConfig.from_args(args, GENERATE_FLAGS)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
    config = config.resolve()
    device_type = config.model.device.split(":")[0]
    tp = config.parallel.tensor_parallel
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        from .parallel import init_from_env

        rank, world = init_from_env(device_type)
        out = generate_on_rank(rank, world, config, args)
    elif tp > 1:  # start the ranks ourselves, once the split is known to fit
        from .parallel import check_divisible, launch

        check_divisible(target_config(config.model.id, config.model.revision), tp)

        rank, out = 0, launch(tp, generate_on_rank, config, args, device_type=device_type)
    else:
        rank, out = 0, generate_on_rank(0, 1, config, args)
    if rank == 0:
        print(json.dumps(out) if args.json else out["text"])
    return 0


def generate_on_rank(rank: int, world: int, config: EngineConfig, args) -> dict:
    """Load, split over `world` ranks when > 1, and generate; every rank computes the same tokens."""
    from .build import load_models, make_engine
    from .engine import SamplingParams

    loaded = load_models(config, rank, world)
    target, tokenizer = loaded.target, loaded.tokenizer
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"{config.model.id}'s tokenizer has no chat template: leave out --chat")
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    max_seq = config.serving.max_seq_len or len(prompt_ids) + args.max_new_tokens
    # one sequence; the cache is sized after tokenizing, so load and build are two steps here
    engine = make_engine(target, loaded.drafter, config.speculation, max_batch_size=1, max_seq_len=max_seq)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
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
        "method": config.speculation.method,
        "budget": engine.budget,
        "tensor_parallel": world,
    }


def cmd_smoke(args) -> int:
    from .build import build_engine
    from .smoke import run_smoke, write_termination_log

    config = EngineConfig.from_args(args, SMOKE_FLAGS).resolve()
    sizes = list(config.kernels.batch_buckets or DEFAULT_SMOKE_BUCKETS)
    engine, tokenizer = build_engine(config, max_batch_size=max(sizes))
    if engine.device.type == "cuda" and config.kernels.graphs:
        engine.capture_graphs(batch_buckets=sizes)
    texts = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time", "import numpy as np\n"]
    report = run_smoke(
        engine,
        sizes,
        [tokenizer.encode(t) for t in texts],
        max_new_tokens=args.max_new_tokens,
        min_acceptance=args.min_acceptance,
        fault=args.fault,
    )
    if not report.passed:
        write_termination_log(report.reason, config.serving.termination_log)
    print(report.reason, file=sys.stderr)
    print(json.dumps(report.to_json()))
    return 0 if report.passed else 1


BENCH_PROMPTS = [
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
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

    from .bench import BenchPlan
    from .kernels import available

    both = getattr(args, "kernels", None) == "both"
    config = EngineConfig.from_args(args, {d: f for d, f in BENCH_FLAGS.items() if not (both and d == "kernels")})
    # bench sweeps --methods and --budgets over one load: the file's speculation section does not apply
    config = config.replace(speculation={"method": "ddtree", "budget": None, "block_size": None})
    config = config.resolve(default_drafter=False)
    device = config.model.device
    if device == "cpu" and (args.graphs != "off" or args.capture_all or args.hf_baseline):
        raise UsageError("on CPU, bench runs only with --graphs off and without --capture-all/--hf-baseline")
    kernels = "both" if both else config.kernels.backend
    if kernels == "auto":
        variants = ["triton"] if device.startswith("cuda") and available(device) else ["torch"]
    else:
        variants = ["torch", "triton"] if kernels == "both" else [kernels]
        if "triton" in variants and not available(device):
            raise UsageError(
                f"--kernels {kernels} needs triton and a CUDA device (on CPU only under TRITON_INTERPRET=1, slowly)"
            )
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - {"ar", "dflash", "ddtree"}
    if unknown:
        raise UsageError(f"unknown methods {sorted(unknown)} in --methods")
    plan = BenchPlan(
        methods=methods,
        budgets=parse_int_list(args.budgets, "--budgets"),
        batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"),
        graph_modes={"on": [True], "off": [False], "both": [False, True]}[args.graphs],
        kernel_variants=variants,
        rounds=args.rounds,
        ctx=args.ctx,
        micro=args.micro,
        capture_all=args.capture_all,
        hf_baseline=args.hf_baseline,
        out=args.out,
    )
    tp = config.parallel.tensor_parallel
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        from .parallel import init_from_env

        bench_on_rank(*init_from_env(device.split(":")[0]), config, plan)
    elif tp > 1:
        if args.hf_baseline:
            raise UsageError("--hf-baseline runs on one device: leave out --tensor-parallel")
        if device.startswith("cuda") and torch_cuda_count() < tp:
            raise UsageError(f"--tensor-parallel {tp} needs {tp} GPUs, this host has {torch_cuda_count()}")
        from .parallel import check_divisible, launch

        check_divisible(target_config(config.model.id, config.model.revision), tp)
        launch(tp, bench_on_rank, config, plan, device_type=device.split(":")[0])
    else:
        bench_on_rank(0, 1, config, plan)
    return 0


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def bench_on_rank(rank: int, world: int, config: EngineConfig, plan) -> None:
    """Load (and split over `world` ranks when > 1) and run the benchmark; rank 0 prints and writes."""
    import torch

    from .bench import run_bench
    from .build import load_models

    # every measurement picks its kernel variant itself (bench.use_kernels): load with the PyTorch path
    loaded = load_models(config.replace(kernels={"backend": "torch"}), rank, world)
    target, tokenizer, model = loaded.target, loaded.tokenizer, config.model.id
    if model.startswith("random:"):
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.config.vocab_size, (plan.ctx,), generator=g).tolist() for _ in range(4)]
        label = f"{model} (random weights: acceptance is meaningless, cost only)"
    else:
        prompts = []
        for text in BENCH_PROMPTS:
            if text.startswith(("def ", "class ", "import ")):
                prompts.append(tokenizer.encode(text))
            else:
                prompts.append(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": text}],
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=False,
                    )
                )
        label = f"{model} + {config.model.drafter or 'no drafter'}"
    if world > 1:
        label += f", tensor parallel {world} (drafter {loaded.drafter_split})"
    run_bench(plan, target, loaded.drafter, prompts, label, report=rank == 0)


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
    print(
        f"wrote a random-init DFlash drafter ({args.layers} layers, block {args.block_size}, taps "
        f"{cfg.target_layer_ids}) to {out}"
    )
    return 0


# The engine flags have no argparse default (SUPPRESS): an untyped flag is absent from the namespace, so
# that EngineConfig.from_args applies only what the user typed over the --config file, and the defaults
# come from ddtree.config's dataclasses.
UNSET = argparse.SUPPRESS


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help='YAML or JSON file of engine settings (docs/engine.md, "Configuration"); flags given here override it',
    )


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=UNSET,
        help="split the target over N processes (one GPU each; gloo on CPU); torchrun works too",
    )
    p.add_argument(
        "--replicate-drafter",
        action="store_true",
        default=UNSET,
        help="with --tensor-parallel: run the whole drafter on every rank instead of splitting its "
        "layers like the target's (the default when its heads divide)",
    )


KERNELS_HELP = (
    "element-wise path of the target: PyTorch ops, fused Triton kernels (CUDA), or auto (Triton on "
    f"CUDA when available); default {DEFAULT_KERNELS}"
)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--config and the model/drafter/speculation/device flags of generate, serve and smoke."""
    add_config_flag(p)
    p.add_argument(
        "--model",
        default=UNSET,
        help="built-in id (smollm2-135m-instruct), local folder, .gguf or hub id (required, here or in --config)",
    )
    p.add_argument("--drafter", default=UNSET, help="DFlash drafter: local folder, built-in id or hub id")
    p.add_argument("--method", choices=["ar", "dflash", "ddtree"], default=UNSET, help="default ddtree")
    p.add_argument("--budget", type=parse_budget, default=UNSET, help=BUDGET_HELP)


def add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=UNSET, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--dtype", default=UNSET, help="float32 / bfloat16 / float16 (default: bfloat16 on cuda, float32 on cpu)"
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--max-seq-len", type=int, default=UNSET, help="KV cache length per sequence (default 2048)")
    add_device_flags(p)
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default=UNSET, help=KERNELS_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddtree", description="DDTree speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_model_flags(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-seq-len", type=int, default=UNSET, help="KV cache length (default: prompt + max new tokens)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--prompt", required=True)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    add_device_flags(g)
    g.add_argument("--kernels", choices=KERNEL_CHOICES, default=UNSET, help=KERNELS_HELP)
    add_parallel_flags(g)
    g.set_defaults(func=cmd_generate)

    sm = sub.add_parser("smoke", help="capture graphs and compare them with eager execution (readiness gate)")
    add_engine_flags(sm)
    sm.add_argument(
        "--batch-sizes",
        default=UNSET,
        help="batch sizes to test (and capture graphs for); default 1,2,4 (kernels.batch_buckets)",
    )
    sm.add_argument("--max-new-tokens", type=int, default=8)
    sm.add_argument("--min-acceptance", type=float, default=1.0, help="fail below this acceptance length")
    sm.add_argument(
        "--termination-log", default=UNSET, help="file for the failure reason (default /dev/termination-log if present)"
    )
    sm.add_argument("--no-graphs", action="store_true", default=UNSET, help="compare batched eager rounds only")
    sm.add_argument("--fault", choices=["corrupt-graph-input"], help=argparse.SUPPRESS)
    sm.set_defaults(func=cmd_smoke)

    b = sub.add_parser("bench", help="benchmark ar / dflash / ddtree with and without CUDA graphs")
    add_config_flag(b)
    b.add_argument("--model", default=UNSET, help="model id, or random:qwen3-8b for random weights of that shape")
    b.add_argument("--drafter", default=UNSET, help="drafter id, or random:LAYERS for a random-init drafter")
    b.add_argument("--methods", default="ar,dflash,ddtree")
    b.add_argument("--budgets", default="8,16,32,64,128")
    b.add_argument("--batch-sizes", default="1,4,16,64")
    b.add_argument("--graphs", choices=["on", "off", "both"], default="both")
    b.add_argument("--ctx", type=int, default=1024, help="prompt length for random models")
    add_parallel_flags(b)
    b.add_argument("--rounds", type=int, default=16, help="timed rounds per configuration")
    b.add_argument("--micro", action="store_true", help="also time single target forwards vs the HBM bound")
    b.add_argument(
        "--kernels",
        choices=[*KERNEL_CHOICES, "both"],
        default=UNSET,
        help="element-wise path of the target: PyTorch ops, Triton kernels, auto, or both in turn, "
        f"with the logit difference in --micro; default {DEFAULT_KERNELS}",
    )
    b.add_argument("--hf-baseline", action="store_true", help="also time transformers generate")
    b.add_argument("--capture-all", action="store_true", help="also time capturing every batch/span bucket")
    b.add_argument(
        "--device", default=UNSET, help="cuda (default when available) or cpu (acceptance and eager speed only)"
    )
    b.add_argument("--dtype", default=UNSET, help="default: bfloat16 on cuda, float32 on cpu")
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
    except (UsageError, ModelNotFoundError, DrafterMismatchError, ValueError) as exc:  # ConfigError too
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # run the package's module, not this __main__ copy, so that UsageError is one class everywhere
    from ddtree.cli import main as package_main

    sys.exit(package_main())
