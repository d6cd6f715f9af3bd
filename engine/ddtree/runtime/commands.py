"""`ddtree generate`, `ddtree smoke` and `ddtree bench`: from parsed arguments to engine runs."""

from __future__ import annotations

import json
import os
import sys

from ..config import (
    BENCH_FLAGS,
    DEFAULT_SMOKE_BUCKETS,
    GENERATE_FLAGS,
    SMOKE_FLAGS,
    EngineConfig,
    UsageError,
    parse_int_list,
)
from .build import stop_ids, target_config


def cmd_generate(args) -> int:

    config = EngineConfig.from_args(args, GENERATE_FLAGS)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= args.min_p <= 1:
        raise UsageError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0 and --min-p in [0, 1]")
    config = config.resolve()
    device_type = config.model.device.split(":")[0]
    tp = config.parallel.tensor_parallel
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        from .parallel import init_from_env

        rank, world = init_from_env(device_type)
        out = generate_on_rank(rank, world, config, args)
    elif tp > 1:  # start the ranks ourselves, once the split is known to fit
        from .parallel import check_divisible, launch

        check_divisible(
            target_config(config.model.id, config.model.revision),
            tp,
            whole_experts=config.parallel.expert_parallel != 1,
        )

        rank, out = 0, launch(tp, generate_on_rank, config, args, device_type=device_type)
    else:
        rank, out = 0, generate_on_rank(0, 1, config, args)
    if rank == 0:
        print(json.dumps(out) if args.json else out["text"])
    return 0


def generate_on_rank(rank: int, world: int, config: EngineConfig, args) -> dict:
    """Load, split over `world` ranks when > 1, and generate; every rank computes the same tokens."""
    from .build import load_models, make_engine, model_context
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
    context, why = model_context(target.config)
    if max_seq > context:
        asked = (
            f"{config.name('serving.max_seq_len')} {max_seq:,} is"
            if config.serving.max_seq_len
            else f"the prompt ({len(prompt_ids):,} tokens) and --max-new-tokens {args.max_new_tokens:,} come to "
            f"{max_seq:,} tokens,"
        )
        raise UsageError(f"{asked} more than {config.model.id}'s context of {context:,} tokens ({why})")
    # one sequence; the cache is sized after tokenizing, so load and build are two steps here
    engine = make_engine(target, loaded.drafter, config.speculation, max_batch_size=1, max_seq_len=max_seq)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
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
    for flag, value in (("--rounds", args.rounds), ("--ctx", args.ctx)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - {"ar", "dflash", "ddtree"}
    if unknown:
        raise UsageError(f"unknown methods {sorted(unknown)} in --methods")
    if args.policy and "ddtree" not in methods:
        raise UsageError("--policy runs ddtree: add ddtree to --methods")
    plan = BenchPlan(
        methods=methods,
        budgets=parse_int_list(args.budgets, "--budgets"),
        policies=args.policy,
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

        check_divisible(
            target_config(config.model.id, config.model.revision),
            tp,
            whole_experts=config.parallel.expert_parallel != 1,
        )
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
