"""`ddtree make-data` and `ddtree train-drafter`: from parsed arguments to data and a trained drafter."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch

from ..speculative.drafter import (
    DrafterConfig,
    init_drafter,
    save_drafter,
)
from .data import TokenData
from .loop import find_checkpoint, train_drafter
from .recipe import RESUMABLE, TrainConfig


def _usage(msg: str):
    from ..config import UsageError

    return UsageError(msg)


def _parse_ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise _usage(f"{flag} takes comma-separated integers, got '{text}'") from None


def _data_path(p: str) -> Path:
    path = Path(p)
    return path / "data.safetensors" if path.suffix != ".safetensors" else path


def _file_errors_as_usage(handler):
    """Missing data / corpus / checkpoint paths are user errors: one line, exit code 2."""
    import functools

    @functools.wraps(handler)
    def run(args) -> int:
        try:
            return handler(args)
        except FileNotFoundError as exc:
            raise _usage(str(exc)) from None

    return run


@_file_errors_as_usage
def cmd_make_data(args) -> int:
    from ..runtime.build import device_and_dtype, load_target
    from .data import make_data

    for name in ("num_prompts", "prompt_tokens", "continuation_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise _usage(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.held_out < 1:
        raise _usage(f"--held-out must be in [0, 1), got {args.held_out}")
    mix = _parse_mix(args.mix)
    device, dtype = device_and_dtype(args.device, args.dtype)
    target, tok = load_target(args.target, device, dtype)
    out = _data_path(args.out)
    data = make_data(
        target,
        out,
        tokenizer=tok,
        num_prompts=args.num_prompts,
        prompt_tokens=args.prompt_tokens,
        continuation_tokens=args.continuation_tokens,
        held_out_fraction=args.held_out,
        seed=args.seed,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        sources=args.source or ["stdlib"],
        mix=mix,
        target_name=args.target,
    )
    m = data.manifest
    print(
        f"wrote {m['num_sequences']} sequences ({m['num_train']} train, {m['num_held_out']} held out), "
        f"{m['tokens']} tokens ({m['continuation_tokens']} generated) in {m['seconds_total']:.0f} s to {out}"
    )
    return 0


def _parse_mix(text: str) -> tuple[float, float, float]:
    try:
        mix = tuple(float(x) for x in text.split(","))
    except ValueError:
        mix = ()
    if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
        raise _usage(f"--mix takes three non-negative weights code,prose,chat; got '{text}'")
    return mix  # type: ignore[return-value]


@_file_errors_as_usage
def cmd_train_drafter(args) -> int:
    from ..runtime.build import device_and_dtype, load_target
    from .data import make_data

    if args.resume and args.init:
        raise _usage("--resume and --init exclude each other")
    if args.init_from_target and (args.init or args.resume):
        raise _usage("--init-from-target excludes --init and --resume")
    for name in ("layers", "steps", "batch_size", "anchors_per_seq"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise _usage(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.block_size < 2:
        raise _usage(f"--block-size must be >= 2, got {args.block_size}")
    if args.gamma <= 0 or args.lr <= 0 or not 0 <= args.warmup < 1:
        raise _usage("--gamma and --lr must be > 0 and --warmup in [0, 1)")
    device, dtype = device_and_dtype(args.device, args.dtype)
    torch.manual_seed(args.seed)
    target, tok = load_target(args.target, device, dtype)
    if args.resume and not args.data:  # the data the checkpoint was trained on
        saved = json.loads((find_checkpoint(args.resume) / "trainer_state.json").read_text()).get("data")
        args.data = saved or None
    data_path = _data_path(args.data) if args.data else Path(args.out) / "data.safetensors"
    if not data_path.is_file():
        if args.data and not args.make_data:
            raise _usage(f"no training data at {data_path}: run `ddtree make-data` or pass --make-data")
        print(f"making training data at {data_path} ({args.data_prompts} prompts)", file=sys.stderr)
        make_data(
            target,
            data_path,
            tokenizer=tok,
            num_prompts=args.data_prompts,
            seed=args.seed,
            batch_size=args.data_batch_size,
            continuation_tokens=args.data_continuation_tokens,
            target_name=args.target,
        )
    data = TokenData.load(data_path)
    if data.manifest.get("target") not in (None, args.target, "<in-memory model>"):
        print(
            f"note: the data was generated by '{data.manifest['target']}', training against '{args.target}'",
            file=sys.stderr,
        )
    given = {name: getattr(args, name) for name in RESUMABLE}
    cfg = TrainConfig(
        layers=args.layers,
        block_size=args.block_size,
        taps=_parse_ints(args.taps, "--taps"),
        intermediate_size=args.intermediate_size,
        mask_token_id=args.mask_token_id,
        batch_size=args.batch_size,
        anchors_per_seq=args.anchors_per_seq,
        max_len=args.max_len,
        lr=args.lr,
        warmup=args.warmup,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        gamma=args.gamma,
        seed=args.seed,
        **{k: v for k, v in given.items() if v is not None},
    )
    if args.init_from_target:
        n = target.config.num_hidden_layers
        ids = (
            list(range(n - cfg.layers, n))
            if args.init_from_target == "last"
            else _parse_ints(args.init_from_target, "--init-from-target")
        )
        if len(ids) != cfg.layers or not all(0 <= i < n for i in ids):
            raise _usage(f"--init-from-target needs {cfg.layers} target layer ids in [0, {n}), got {ids}")
        cfg.init_from_target = ids
    if cfg.taps is not None:
        bad = [t for t in cfg.taps if not 0 <= t < target.config.num_hidden_layers]
        if bad:
            raise _usage(f"--taps {bad} outside the target's {target.config.num_hidden_layers} layers")
    command = "ddtree " + " ".join(shlex.quote(a) for a in args.argv)
    res = train_drafter(
        target,
        data,
        args.out,
        None if args.resume else cfg,
        device=device,
        init=args.init,
        resume=args.resume,
        progress=not args.no_progress,
        command=command,
        target_name=args.target,
        data_path=str(data_path),
        overrides=given,
    )
    summary = {
        "out": str(res.out_dir),
        "step": res.step,
        "stopped": res.stopped,
        "held_out": res.eval,
        "acceptance": res.final_eval,
    }
    print(json.dumps(summary))
    return 0


def cmd_init_drafter(args) -> int:
    import torch

    from ..models.checkpoint import load_config, resolve_model
    from ..models.registry import config_from_hf

    if args.layers < 1:
        raise _usage(f"--layers must be >= 1, got {args.layers}")
    if args.block_size < 2:
        raise _usage(f"--block-size must be >= 2, got {args.block_size}")
    target_cfg = config_from_hf(load_config(resolve_model(args.target)))
    cfg = DrafterConfig.for_target(
        target_cfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=args.mask_token_id
    )
    if args.layout == "dflash2":
        import dataclasses

        from ..speculative.dflash2 import DFlash2Config

        cfg = DFlash2Config(**dataclasses.asdict(cfg))
        if cfg.hidden_size % cfg.conv_group_size:
            raise _usage(f"--layout dflash2 needs a hidden size divisible by {cfg.conv_group_size}")
    cfg.check_target(target_cfg)
    drafter = init_drafter(cfg, seed=args.seed).to(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    out = save_drafter(drafter, args.out)
    print(
        f"wrote a random-init {cfg.architecture} drafter ({args.layers} layers, block {args.block_size}, taps "
        f"{cfg.target_layer_ids}) to {out}"
    )
    return 0
