"""The `ddtree` command line: parses arguments and hands them to the command's handler.

Handlers live with their concern (ddtree.runtime.commands, ddtree.serving.commands,
ddtree.training.commands) and are imported only when their command runs, so that `ddtree --help` and
argument errors do not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .config import (
    AUTO,
    KERNEL_CHOICES,
    REASONING_PARSERS,
    SMOKE_FAULTS,
    TOOL_CALL_PARSERS,
    KernelConfig,
    UsageError,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


BUDGET_HELP = (
    "DDTree node budget B (verify width B+1), or one per batch size: 1:32,16:8 runs B=32 for up "
    "to 1 sequence, 8 for up to 16 and beyond; budget 0 decodes without drafting at those batch "
    "sizes (1:32,16:8,64:0; `ddtree bench` prints the measured best); or auto: chosen every round from the "
    "draft's own forecast and measured round times (serve's default for ddtree; elsewhere block_size-1)"
)


def parse_budget(text: str) -> int | dict[int, int] | str:
    """--budget: an integer, BATCH:BUDGET pairs (batch sizes should be graph batch buckets) or auto."""
    if text == AUTO:
        return text
    try:
        if ":" not in text:
            value = int(text)
            if value < 0:
                raise argparse.ArgumentTypeError(f"--budget must be >= 0, got {value}")
            return value
        pairs = [(int(n), int(b)) for n, b in (part.split(":") for part in text.split(","))]
        policy = dict(pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--budget takes an integer, BATCH:BUDGET pairs like 1:32,16:8 or auto, got '{text}'"
        ) from None
    if min(policy) < 1 or min(policy.values()) < 0:
        raise argparse.ArgumentTypeError(f"--budget: batch sizes must be >= 1 and budgets >= 0, got '{text}'")
    if len(policy) < len(pairs):
        raise argparse.ArgumentTypeError(f"--budget: each batch size once, got '{text}'")
    return policy


def parse_policy(text: str) -> dict[int, int]:
    """--policy: BATCH:BUDGET pairs (a budget per batch size, as --budget takes them)."""
    policy = parse_budget(text)
    if not isinstance(policy, dict):
        raise argparse.ArgumentTypeError(f"--policy takes BATCH:BUDGET pairs like 1:32,16:8, got '{text}'")
    return policy


# element-wise path of the target: "auto" = the Triton kernels on CUDA when triton is importable
DEFAULT_KERNELS = KernelConfig.backend  # Triton on CUDA when importable (measured faster and lossless in fp32)


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
        "--expert-parallel",
        type=int,
        default=UNSET,
        help="MoE models: split the routed experts whole over N ranks (N = --tensor-parallel, the default) or, "
        "with 1, split every expert's width over the ranks like a dense MLP",
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
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=UNSET,
        help="run the Python tokenizer code a checkpoint ships (Kimi's tiktoken tokenizer needs it)",
    )
    p.add_argument("--method", choices=["ar", "dflash", "ddtree"], default=UNSET, help="default ddtree")
    p.add_argument("--budget", type=parse_budget, default=UNSET, help=BUDGET_HELP)


def add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=UNSET, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--dtype", default=UNSET, help="float32 / bfloat16 / float16 (default: bfloat16 on cuda, float32 on cpu)"
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=UNSET,
        help="KV cache length per sequence (default 2048, or the model's context where shorter)",
    )
    add_device_flags(p)
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default=UNSET, help=KERNELS_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddtree", description="DDTree speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_model_flags(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most probable tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the most probable one")
    g.add_argument("--seed", type=int)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-seq-len", type=int, default=UNSET, help="KV cache length (default: prompt + max new tokens)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--prompt", required=True)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    add_device_flags(g)
    g.add_argument("--kernels", choices=KERNEL_CHOICES, default=UNSET, help=KERNELS_HELP)
    add_parallel_flags(g)
    g.set_defaults(handler="ddtree.runtime.commands:cmd_generate")

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
    sm.set_defaults(handler="ddtree.runtime.commands:cmd_smoke")

    b = sub.add_parser("bench", help="benchmark ar / dflash / ddtree with and without CUDA graphs")
    add_config_flag(b)
    b.add_argument("--model", default=UNSET, help="model id, or random:qwen3-8b for random weights of that shape")
    b.add_argument("--drafter", default=UNSET, help="drafter id, or random:LAYERS for a random-init drafter")
    b.add_argument("--methods", default="ar,dflash,ddtree")
    b.add_argument("--budgets", default="8,16,32,64,128")
    b.add_argument(
        "--policy",
        action="append",
        type=parse_policy,
        default=[],
        help="also run ddtree under this budget per batch size (BATCH:BUDGET pairs, e.g. the --budget bench "
        "recommends); repeatable",
    )
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
    b.set_defaults(handler="ddtree.runtime.commands:cmd_bench")

    pl = sub.add_parser("plan", help="per-GPU memory plan of a model from its config files (no weights read)")
    pl.add_argument("--model", required=True, help="folder, config.json file, built-in id, hub id or random:SHAPE")
    pl.add_argument("--revision", help="hub revision of --model")
    pl.add_argument("--drafter", help="DFlash drafter: local folder, config.json file, hub id or random:LAYERS")
    pl.add_argument("--drafter-revision", help="hub revision of --drafter")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs = tensor-parallel ranks")
    pl.add_argument(
        "--gpu-memory", help="memory per GPU: 141GiB, 80GB, 288GB or bytes (default: the visible GPU's total)"
    )
    pl.add_argument("--max-context", type=int, help="tokens per sequence (default: its max_position_embeddings)")
    pl.add_argument("--max-batch", type=int, default=1, help="sequences at once (engine rows; default 1)")
    pl.add_argument(
        "--kv-cache-tokens", type=int, help="the KV page pool in tokens (default: --max-batch x --max-context)"
    )
    pl.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="size the KV page pool to what this share of each GPU's memory leaves (serve's flag of that name)",
    )
    pl.add_argument("--budget", type=parse_budget, help="DDTree budget, or 1:32,16:8 (the largest sizes the buffers)")
    pl.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    pl.add_argument("--expert-parallel", type=int, help="1: split every expert's width (default: whole experts)")
    pl.add_argument("--replicate-drafter", action="store_true", help="the whole drafter on every GPU")
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    pl.set_defaults(handler="ddtree.runtime.memory_command:cmd_plan")

    add_serve_commands(sub)
    add_training_commands(sub)

    d = sub.add_parser("init-drafter", help="write a randomly initialised DFlash drafter for a target")
    d.add_argument("--target", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--layers", type=int, default=1)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--mask-token-id", type=int, help="vocabulary row used as MASK (default: the last one)")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    d.add_argument(
        "--layout",
        choices=["dflash", "dflash2"],
        default="dflash",
        help="DFlashDraftModel (default; what train-drafter trains) or DFlash2DraftModel (runs with --method "
        "dflash; its convolutions and selector at the reference's shapes: kernel 4, groups of 64, rank 64, top 8)",
    )
    d.set_defaults(handler="ddtree.training.commands:cmd_init_drafter")
    return parser


def add_serve_commands(subparsers) -> None:
    """Add `serve` (and `bench-serve`) to the `ddtree` command line's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_model_flags(p)  # --config, --model, --drafter, --method, --budget
    p.add_argument("--host", default=UNSET, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=UNSET, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--max-batch-size", type=int, default=UNSET, help="engine rows = concurrently running requests (default 8)"
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=UNSET,
        help="per-request context: prompt + max_tokens, at most the model's context (default 2048, or the "
        "model's context where shorter)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=UNSET,
        help="the KV cache's page pool in tokens, shared by all rows (default: --max-batch-size x --max-seq-len); "
        "requests are admitted while their pages are free",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=UNSET,
        help="instead of --kv-cache-tokens (CUDA): the largest page pool that keeps the engine within this share "
        "of each GPU's memory (0.9: 90%%), as `ddtree plan` counts it, and within the memory the GPU has free",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=UNSET,
        help="prompt tokens per prefill forward and per scheduler iteration, a power of two (default 2048): "
        "long prompts are prefilled in chunks between the running requests' rounds",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        default=UNSET,
        help="prefill every prompt whole (default: a prompt start some engine row still holds is not prefilled again)",
    )
    p.add_argument(
        "--max-waiting", type=int, default=UNSET, help="queued requests beyond the rows before 429 (default 4 x rows)"
    )
    p.add_argument("--served-model-name", default=UNSET, help="model name in the API (default: the --model value)")
    add_device_flags(p)
    p.add_argument(
        "--batch-buckets",
        default=UNSET,
        help="batch sizes for CUDA graphs and the smoke test, e.g. "
        "1,2,4,8 (default: powers of two up to --max-batch-size)",
    )
    p.add_argument("--no-graphs", action="store_true", default=UNSET, help="run rounds eagerly (no CUDA graph capture)")
    p.add_argument(
        "--termination-log",
        default=UNSET,
        help="file for the start-up failure reason (default /dev/termination-log when it exists)",
    )
    p.add_argument("--revision", default=UNSET, help="hub revision of --model (branch, tag or commit)")
    p.add_argument("--drafter-revision", default=UNSET, help="hub revision of --drafter")
    p.add_argument(
        "--block-size", type=int, default=UNSET, help="expected drafter block size (checked against the drafter)"
    )
    add_parallel_flags(p)
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default=UNSET, help=KERNELS_HELP)
    p.add_argument(
        "--api-key-file",
        default=UNSET,
        help="file of API keys, one per line: /v1/* then needs `Authorization: Bearer KEY` "
        "(keys may also come comma-separated in $DDTREE_API_KEY)",
    )
    p.add_argument(
        "--parse-special-tokens",
        action="store_true",
        default=UNSET,
        help="tokenize control-token text in prompts as control tokens (default: as plain text; trusted clients only)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=UNSET,
        help="how tool calls are read from the generated text (default auto: from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=UNSET,
        help="how chat answers' reasoning (<think>...</think>) becomes reasoning_content (default auto: when the "
        "chat template writes <think>)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=UNSET,
        help="most top tokens a request may ask log-probabilities for (default 20; 0 refuses them and response_format)",
    )
    p.add_argument("--max-connections", type=int, default=UNSET, help="open client connections (default 1024)")
    p.add_argument(
        "--header-timeout", type=float, default=UNSET, help="seconds to receive a request's headers (default 30)"
    )
    p.add_argument("--body-timeout", type=float, default=UNSET, help="seconds to receive a request's body (default 60)")
    p.add_argument(
        "--keepalive-timeout", type=float, default=UNSET, help="seconds an idle connection stays open (default 75)"
    )
    p.add_argument("--smoke-fault", choices=list(SMOKE_FAULTS), help=argparse.SUPPRESS)  # tests only
    p.set_defaults(handler="ddtree.serving.commands:cmd_serve")
    b = subparsers.add_parser("bench-serve", help="load generator for a running `ddtree serve`")
    b.add_argument("--url", default="http://127.0.0.1:8000")
    b.add_argument("--concurrency", help="closed loop: comma-separated client counts, run in turn (default 1,8,32,64)")
    b.add_argument("--requests-per-client", type=int, help="closed loop: requests each client sends (default 4)")
    b.add_argument(
        "--request-rate",
        help="open loop instead of --concurrency: comma-separated request rates (per second), run in turn, "
        "each with Poisson arrivals",
    )
    b.add_argument("--num-requests", type=int, help="open loop: requests per rate (default 100)")
    b.add_argument("--seed", type=int, default=0, help="seed of the arrival times and generated prompts (default 0)")
    b.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=0,
        help="a generated system prompt of about this many tokens, the same in every request (default none)",
    )
    b.add_argument(
        "--prompt-lengths",
        help="generated user turns of fixed:N or uniform:LO:HI tokens (default: the built-in prompts)",
    )
    b.add_argument(
        "--turns",
        type=int,
        default=1,
        help="closed loop: each client holds conversations of this many requests, each sending the earlier "
        "turns and replies before a new user turn (default 1: independent requests)",
    )
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--completions", action="store_true", help="raw prompts to /v1/completions (default: chat)")
    b.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: every request generates exactly --max-tokens)",
    )
    b.add_argument("--prompts-file", help="one prompt per line (or one JSON string per line)")
    b.add_argument(
        "--response-format",
        help="every request asks for structured output: json_object, or the path of a JSON Schema file (implies "
        "--no-ignore-eos: the grammar ends the text); each level reports the tokens the grammar replaced",
    )
    b.add_argument("--json", action="store_true", help="one JSON object per level (concurrency or rate)")
    b.set_defaults(handler="ddtree.serving.commands:cmd_bench_serve")
    k = subparsers.add_parser("soak", help="bounded soak of a running `ddtree serve`: leaks, hangs, counters")
    k.add_argument("--url", default="http://127.0.0.1:8000")
    k.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    k.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    k.add_argument("--max-tokens", type=int, default=48, help="each request asks for 1..this many tokens")
    k.add_argument("--hang-up", type=float, default=0.2, help="fraction of requests whose client leaves mid-way")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", action="store_true", help="print the report as one JSON object")
    k.set_defaults(handler="ddtree.serving.commands:cmd_soak")


def add_training_commands(subparsers) -> None:
    """Add `train-drafter` and `make-data` to the `ddtree` command line."""
    m = subparsers.add_parser(
        "make-data", help="self-distillation data: the target continues prompts cut from offline corpora"
    )
    m.add_argument("--target", required=True, help="target: built-in id, local folder or .gguf")
    m.add_argument("--out", required=True, help="output .safetensors file (or folder: FOLDER/data.safetensors)")
    m.add_argument("--num-prompts", type=int, default=4096)
    m.add_argument("--prompt-tokens", type=int, default=128, help="longest prompt (prompts are 1/4..1x this)")
    m.add_argument("--continuation-tokens", type=int, default=256, help="tokens the target generates per prompt")
    m.add_argument("--held-out", type=float, default=0.05, help="held-out fraction (split by source file)")
    m.add_argument(
        "--source",
        action="append",
        help="corpus: stdlib (default), site-packages, or a file/folder of .py/.txt/.md/.rst/.html (repeatable)",
    )
    m.add_argument("--mix", default="0.4,0.2,0.4", help="prompt kinds code,prose,chat (weights)")
    m.add_argument("--batch-size", type=int, default=128)
    m.add_argument("--temperature", type=float, default=0.0, help="0 = greedy continuations")
    m.add_argument("--top-p", type=float, default=1.0)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device")
    m.add_argument("--dtype")
    m.set_defaults(handler="ddtree.training.commands:cmd_make_data")

    t = subparsers.add_parser("train-drafter", help="train a DFlash drafter against a frozen target")
    t.add_argument("--target", required=True, help="target: built-in id, local folder or .gguf")
    t.add_argument("--out", required=True, help="output folder (drafter, checkpoint/, README.md, training_log.jsonl)")
    t.add_argument("--data", help="data from `ddtree make-data` (default: OUT/data.safetensors, made if missing)")
    t.add_argument("--make-data", action="store_true", help="make --data first when it does not exist")
    t.add_argument("--data-prompts", type=int, default=2048, help="prompts when making data here")
    t.add_argument("--data-batch-size", type=int, default=128)
    t.add_argument("--data-continuation-tokens", type=int, default=256)
    t.add_argument("--layers", type=int, default=2, help="drafter layers")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--taps", help="target layer ids, comma separated (default: >= 3 evenly spread layers)")
    t.add_argument("--intermediate-size", type=int, help="drafter MLP width (default: the target's)")
    t.add_argument("--mask-token-id", type=int, help="MASK vocabulary row (default: the last)")
    t.add_argument("--steps", type=int, help="optimizer steps (default 2000)")
    t.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    t.add_argument("--anchors-per-seq", type=int, default=32)
    t.add_argument("--max-len", type=int, default=1024)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    t.add_argument("--min-lr-ratio", type=float, default=0.0)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of block slot k")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=int, help="log every N steps (default 10)")
    t.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (default 250; 0: only at the end)")
    t.add_argument("--eval-batches", type=int, help="held-out batches per evaluation (default 4)")
    t.add_argument("--save-every", type=int, help="checkpoint every N steps (default 500; 0: only at the end)")
    t.add_argument(
        "--max-minutes",
        type=float,
        help="stop cleanly after this many minutes of this run's training loop (then evaluates and saves)",
    )
    t.add_argument(
        "--final-eval-prompts",
        type=int,
        help="held-out prompts for the Engine acceptance measurement (default 8; 0: skip)",
    )
    t.add_argument("--final-eval-tokens", type=int, help="default 128")
    t.add_argument("--final-eval-budget", type=int, help="DDTree budget of the final measurement (default 32)")
    t.add_argument(
        "--save-dtype", choices=["bfloat16", "float32"], help="dtype of the saved drafter (default bfloat16)"
    )
    t.add_argument("--init", help="start from this drafter folder instead of random weights")
    t.add_argument(
        "--init-from-target",
        nargs="?",
        const="last",
        metavar="LAYERS",
        help="start the drafter layers as copies of target layers: comma-separated ids, or 'last' "
        "(the default when the flag has no value) for the target's last --layers layers",
    )
    t.add_argument("--resume", help="continue from OUT (or its checkpoint/ folder)")
    t.add_argument("--device")
    t.add_argument("--dtype", help="target dtype (default: bfloat16 on cuda, float32 on cpu)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(handler="ddtree.training.commands:cmd_train_drafter")


def run(argv: list[str] | None = None) -> int:
    """Parse `argv` and run its command's handler; errors propagate (main turns them into one line)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the record of the command (model cards)
    module, _, name = args.handler.partition(":")
    return getattr(importlib.import_module(module), name)(args)


def main(argv: list[str] | None = None) -> int:
    from .models.checkpoint import ModelNotFoundError
    from .speculative.drafter import DrafterMismatchError

    try:
        return run(argv)
    except (UsageError, ModelNotFoundError, DrafterMismatchError, ValueError) as exc:  # ConfigError too
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
