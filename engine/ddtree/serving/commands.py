"""`ddtree serve` and `ddtree bench-serve`: from parsed arguments to a running server or a load run."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys

from ..config import AUTO, FLAGS, EngineConfig, UsageError, parse_int_list
from .app import EngineServer, serve_follower, serve_until_stopped
from .loadgen import PromptLengths, bench_line, bench_serve, response_format_arg


def _int_list(text: str, flag: str) -> list[int]:
    return sorted(set(parse_int_list(text, flag)))


SERVE_FLAGS = FLAGS  # serve has a flag for every field


def serve_config(args) -> EngineConfig:
    """The `serve` settings (--config file and flags), validated (ConfigError on bad ones) and resolved:
    device, dtype and drafter filled in; the batch buckets are checked against max_batch_size."""
    config = EngineConfig.from_args(args, SERVE_FLAGS).resolve()
    if config.speculation.method == "ddtree" and config.speculation.budget is None:
        config = config.replace(speculation={"budget": AUTO})  # serve chooses each round's budget
    config.serve_batch_sizes()
    return config


def _tensor_parallel(config: EngineConfig) -> tuple[int, int, bool]:
    """(rank, world, spawn_followers): started by torchrun (WORLD_SIZE set), or --tensor-parallel ranks that
    this process starts itself (as rank 0). A split that does not fit is refused before anything starts."""
    tp, flag = config.parallel.tensor_parallel, config.name("parallel.tensor_parallel")
    torchrun = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else tp
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    spawn_followers = world > 1 and not torchrun
    if torchrun and tp not in (1, world):
        raise UsageError(f"{flag} {tp} differs from torchrun's WORLD_SIZE {world}")
    if world == 1:
        return rank, world, spawn_followers
    if spawn_followers and config.model.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < world:
            raise UsageError(f"{flag} {world} needs {world} GPUs, this host has {torch.cuda.device_count()}")
    from ..models.checkpoint import peek_config
    from ..models.random import RANDOM_PREFIX, random_config
    from ..models.registry import config_from_hf
    from ..runtime.parallel import check_divisible

    ref, revision = config.model.id, config.model.revision
    model_config = random_config(ref) if ref.startswith(RANDOM_PREFIX) else peek_config(ref, revision)
    if isinstance(model_config, dict):
        model_config = config_from_hf(model_config)
    if model_config is not None:  # otherwise shard() refuses it at load time (a start-up failure)
        check_divisible(model_config, world, whole_experts=config.parallel.expert_parallel != 1)  # one line, exit 2
    return rank, world, spawn_followers


def cmd_serve(args) -> int:
    from .auth import load_api_keys

    config = serve_config(args)
    rank, world, spawn_followers = _tensor_parallel(config)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
    if rank > 0:  # a torchrun process other than rank 0
        return serve_follower(rank, world, config)
    server = EngineServer(config, world, smoke_fault=args.smoke_fault, api_keys=load_api_keys(config))
    if spawn_followers:
        from ..runtime.parallel import start_followers

        server.followers = start_followers(world, serve_follower, config, device_type=config.model.device.split(":")[0])
    try:
        code = asyncio.run(serve_until_stopped(server))
    finally:
        clean = server.stop_followers()
    if not clean or (server.loader is not None and server.loader.is_alive()):
        # stopped while loading, or a thread is stuck in a collective: don't join torch
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _client_key() -> str | None:
    """The key load generators send: the first of $DDTREE_API_KEY, the variable the server reads too."""
    from .auth import KEYS_ENV

    return next((k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip()), None)


def _rate_list(text: str) -> list[float]:
    """--request-rate: '2,4,8' -> [2.0, 4.0, 8.0]."""
    try:
        rates = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        rates = []
    if not rates or rates[0] <= 0 or not all(math.isfinite(r) for r in rates):
        raise UsageError(f"--request-rate takes comma-separated positive numbers (requests per second), got '{text}'")
    return rates


def cmd_bench_serve(args) -> int:
    open_loop = args.request_rate is not None
    closed_flags = [
        flag
        for flag, value in (("--concurrency", args.concurrency), ("--requests-per-client", args.requests_per_client))
        if value is not None
    ]
    if open_loop and closed_flags:
        raise UsageError(
            f"--request-rate (open loop: Poisson arrivals) and {closed_flags[0]} (closed loop: clients that send "
            "back to back) are exclusive; give one"
        )
    if not open_loop and args.num_requests is not None:
        raise UsageError("--num-requests goes with --request-rate (closed loop: --requests-per-client)")
    rates = _rate_list(args.request_rate) if open_loop else None
    levels = _int_list(args.concurrency or "1,8,32,64", "--concurrency")
    requests_per_client = 4 if args.requests_per_client is None else args.requests_per_client
    num_requests = 100 if args.num_requests is None else args.num_requests
    if min(requests_per_client, num_requests, args.max_tokens) < 1:
        raise UsageError("--requests-per-client, --num-requests and --max-tokens must be >= 1")
    if args.system_prompt_tokens < 0:
        raise UsageError(f"--system-prompt-tokens must be >= 0, got {args.system_prompt_tokens}")
    prompt_lengths = PromptLengths.parse(args.prompt_lengths) if args.prompt_lengths else None
    if prompt_lengths and args.prompts_file:
        raise UsageError("--prompt-lengths generates the user turns, --prompts-file gives them: give one")
    prompts = None
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [
                json.loads(line) if line.lstrip().startswith('"') else line.rstrip("\n") for line in f if line.strip()
            ]
    response_format = response_format_arg(args.response_format) if args.response_format else None
    results = asyncio.run(
        bench_serve(
            args.url,
            levels,
            requests_per_client,
            args.max_tokens,
            prompts,
            chat=not args.completions,
            temperature=args.temperature,
            ignore_eos=not (args.no_ignore_eos or response_format),
            api_key=_client_key(),
            request_rates=rates,
            num_requests=num_requests,
            system_prompt_tokens=args.system_prompt_tokens,
            prompt_lengths=prompt_lengths,
            seed=args.seed,
            response_format=response_format,
            turns=args.turns,
        )
    )
    for r in results:
        print(json.dumps(r) if args.json else bench_line(r))
    return 0 if all(r["errors"] == 0 for r in results) else 1


def cmd_soak(args) -> int:
    """Exit 0 when every check of the soak held (the API key, if the server wants one: $DDTREE_API_KEY)."""
    from .soak import soak, soak_lines

    if args.duration <= 0 or args.clients < 1 or args.max_tokens < 1 or not 0 <= args.hang_up <= 1:
        raise UsageError("--duration, --clients and --max-tokens must be positive and --hang-up in [0, 1]")
    report = asyncio.run(
        soak(
            args.url, args.duration, args.clients, args.max_tokens, args.hang_up, seed=args.seed, api_key=_client_key()
        )
    )
    print(json.dumps(report) if args.json else soak_lines(report))
    return 0 if report["ok"] else 1
