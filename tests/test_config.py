"""The typed configuration (ddtree.config): defaults, one-line validation errors, --config FILE with the
flags the user typed on top, unknown keys refused, YAML/JSON round trips, and `generate --config` end to end."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from ddtree.cli import build_parser
from ddtree.config import FLAGS, ConfigError, EngineConfig


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_defaults():
    c = EngineConfig()
    assert (c.speculation.method, c.speculation.budget, c.speculation.block_size) == ("ddtree", None, None)
    assert (c.kernels.backend, c.kernels.graphs, c.kernels.batch_buckets) == ("auto", True, None)
    assert (c.parallel.tensor_parallel, c.parallel.replicate_drafter) == (1, False)
    s = c.serving
    assert (s.host, s.port, s.max_batch_size, s.max_seq_len, s.max_waiting) == ("127.0.0.1", 8000, 8, None, None)
    assert (s.seq_len, s.waiting_limit) == (2048, 32)
    assert set(c.to_dict()) == {"model", "speculation", "kernels", "parallel", "serving"}
    # the command line without a file gives the dataclass defaults (argparse defaults do not hide them)
    args = parse("serve", "--model", "m")
    assert EngineConfig.from_args(args, FLAGS) == EngineConfig.from_dict({"model": {"id": "m"}})


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"serving": {"port": 70000}}, "serving.port must be in 0..65535, got 70000"),
        ({"serving": {"max_batch_size": 0}}, "serving.max_batch_size must be >= 1"),
        ({"serving": {"max_seq_len": 8}}, "serving.max_seq_len must be >= 16"),
        (
            {"serving": {"max_seq_len": 4096, "kv_cache_tokens": 4000}},
            "serving.kv_cache_tokens must hold one request of serving.max_seq_len (4096 tokens), got 4000",
        ),
        ({"serving": {"kv_cache_tokens": 2047}}, "serving.kv_cache_tokens must hold one request of"),
        (
            {"serving": {"kv_cache_tokens": 4096, "gpu_memory_utilization": 0.9}},
            "give serving.kv_cache_tokens or serving.gpu_memory_utilization, not both",
        ),
        (
            {"serving": {"gpu_memory_utilization": 1.2}},
            "serving.gpu_memory_utilization must be more than 0 and at most 1, got 1.2",
        ),
        ({"serving": {"max_waiting": -1}}, "serving.max_waiting must be >= 0"),
        ({"serving": {"served_model_name": " "}}, "serving.served_model_name must not be empty"),
        ({"serving": {"port": "80"}}, "serving.port must be an integer"),
        ({"speculation": {"method": "beam"}}, "speculation.method must be one of ar, dflash, ddtree"),
        ({"speculation": {"budget": -1}}, "speculation.budget must be >= 0"),
        ({"speculation": {"budget": {0: 8}}}, "speculation.budget: batch sizes must be >= 1"),
        (
            {"speculation": {"method": "dflash", "budget": {1: 8}}},
            "a budget per batch size needs speculation.method ddtree (got speculation.method dflash)",
        ),
        ({"speculation": {"block_size": 1}}, "speculation.block_size must be >= 2"),
        ({"kernels": {"backend": "cuda"}}, "kernels.backend must be one of auto, torch, triton"),
        ({"kernels": {"graphs": "yes"}}, "kernels.graphs must be true or false"),
        ({"kernels": {"batch_buckets": [1, 0]}}, "kernels.batch_buckets must be a non-empty list of positive"),
        ({"parallel": {"tensor_parallel": 0}}, "parallel.tensor_parallel must be >= 1"),
        (
            {"parallel": {"tensor_parallel": 8, "expert_parallel": 4}},
            "parallel.expert_parallel must be 1 or parallel.tensor_parallel (8), got 4",
        ),
        ({"model": {"trust_remote_code": "yes"}}, "model.trust_remote_code must be true or false"),
        ({"model": {"dtype": "int8"}}, "unknown model.dtype 'int8'"),
        ({"model": {"id": None}}, "model.id is required"),
    ],
)
def test_validation_errors_are_one_line_naming_the_field(data, needle):
    data = {**data, "model": {"id": "m", **data.get("model", {})}}
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_dict(data)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_unknown_sections_and_keys_are_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'serving.prot' \(known in serving: host, port, "):
        EngineConfig.from_dict({"model": {"id": "m"}, "serving": {"prot": 1}})
    path = tmp_path / "c.yaml"
    path.write_text("model: {id: m}\nservng: {port: 1}\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_file(path)
    assert str(err.value) == (
        f"unknown section 'servng' in {path} (known: model, speculation, kernels, parallel, serving)"
    )


def test_file_then_typed_flags_override(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"id": "smollm2-135m-instruct", "dtype": "bfloat16"},
                "speculation": {"method": "ddtree", "budget": {1: 32, 16: 8}},
                "kernels": {"graphs": False, "batch_buckets": [1, 2, 4]},
                "serving": {"port": 9000, "max_batch_size": 16, "max_seq_len": 4096},
            }
        )
    )
    only_file = EngineConfig.from_args(parse("serve", "--config", str(path)), FLAGS)
    assert only_file.speculation.budget == {1: 32, 16: 8} and only_file.serving.port == 9000
    assert only_file.kernels.graphs is False and only_file.kernels.batch_buckets == (1, 2, 4)
    c = EngineConfig.from_args(
        parse(
            "serve",
            "--config",
            str(path),
            "--port",
            "0",
            "--budget",
            "12",
            "--max-seq-len",
            "512",
            "--model",
            "other",
            "--tensor-parallel",
            "1",
        ),
        FLAGS,
    )
    assert (c.model.id, c.speculation.budget, c.serving.port, c.serving.max_seq_len) == ("other", 12, 0, 512)
    # what was not typed keeps the file's value, then the default
    assert (c.model.dtype, c.serving.max_batch_size, c.kernels.graphs, c.serving.host) == (
        "bfloat16",
        16,
        False,
        "127.0.0.1",
    )
    # an error names the flag when the value was typed, the field when it came from the file
    with pytest.raises(ConfigError, match="^--max-batch-size must be >= 1, got 0$"):
        EngineConfig.from_args(parse("serve", "--config", str(path), "--max-batch-size", "0"), FLAGS)
    with pytest.raises(ConfigError, match=r"^a budget per batch size needs --method ddtree \(got --method ar\)$"):
        EngineConfig.from_args(parse("serve", "--config", str(path), "--method", "ar"), FLAGS)
    path.write_text("model: {id: m}\nserving: {max_batch_size: 0}\n")
    with pytest.raises(ConfigError, match="^serving.max_batch_size must be >= 1, got 0$"):
        EngineConfig.from_args(parse("serve", "--config", str(path)), FLAGS)


def test_yaml_and_json_round_trip(tmp_path):
    c = EngineConfig.from_dict(
        {
            "model": {"id": "smollm2-135m-instruct", "drafter": "d", "revision": "main", "device": "cpu"},
            "speculation": {"method": "ddtree", "budget": {1: 32, 16: 8, 64: 0}, "block_size": 16},
            "kernels": {"backend": "torch", "graphs": False, "batch_buckets": [1, 2, 4, 8]},
            "parallel": {"tensor_parallel": 3, "replicate_drafter": True},
            "serving": {
                "host": "0.0.0.0",
                "port": 8080,
                "max_batch_size": 8,
                "max_seq_len": 1024,
                "max_waiting": 2,
                "served_model_name": "smol",
                "termination_log": "/tmp/t",
            },
        }
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c.to_dict()))
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))  # budget keys become strings in JSON
    assert EngineConfig.from_file(tmp_path / "c.yaml") == c
    assert EngineConfig.from_file(tmp_path / "c.json") == c
    assert yaml.safe_load(yaml.safe_dump(c.to_dict())) == c.to_dict()
    # the flag syntax of a budget works in a file too
    assert EngineConfig.from_dict(
        {"model": {"id": "m"}, "speculation": {"budget": "1:32,16:8"}}
    ).speculation.budget == {1: 32, 16: 8}


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "ddtree", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def test_generate_with_a_config_file_end_to_end(tmp_path):
    path = tmp_path / "generate.yaml"
    path.write_text(
        "model:\n  id: random:tiny\n  drafter: random:2\n  device: cpu\n"
        "speculation:\n  method: ddtree\n  budget: {1: 4, 16: 2}\n"
    )
    common = ["--prompt", "hello world", "--max-new-tokens", "6", "--json"]
    r = run_cli("generate", "--config", str(path), *common)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["method"], out["budget"], len(out["token_ids"])) == ("ddtree", 4, 6)
    flags = run_cli(
        "generate",
        "--model",
        "random:tiny",
        "--drafter",
        "random:2",
        "--device",
        "cpu",
        "--budget",
        "1:4,16:2",
        *common,
    )
    assert flags.returncode == 0, flags.stderr
    assert json.loads(flags.stdout.strip().splitlines()[-1])["token_ids"] == out["token_ids"]
    r = run_cli("generate", "--config", str(path), "--method", "ar", "--budget", "0", *common)  # flags win
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["method"] == "ar"
    path.write_text("model: {id: random:tiny}\nspeculation: {methd: ar}\n")
    bad = run_cli("generate", "--config", str(path), *common)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"ddtree: error: unknown key 'speculation.methd' in {path} (known in speculation: method, budget, block_size)"
    ]
    missing = run_cli("generate", "--config", str(tmp_path / "nope.yaml"), *common)
    assert missing.returncode == 2 and "cannot read config file" in missing.stderr


def test_bad_numbers_devices_and_config_files_are_one_line_errors(tmp_path, capsys):
    """Refused before anything loads: each is one line on stderr and exit status 2."""
    from ddtree.cli import main

    llama = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    folders = {}
    for name, change in [("no-layers", {"num_hidden_layers": None}), ("text-width", {"hidden_size": "64"})]:
        folder = tmp_path / name
        folder.mkdir()
        cfg = {k: v for k, v in {**llama, **change}.items() if v is not None}
        (folder / "config.json").write_text(json.dumps(cfg))
        folders[name] = str(folder)
    tiny = ["--model", "random:tiny", "--drafter", "random:1", "--device", "cpu", "--graphs", "off", "--methods", "ar"]
    for argv, message in [
        (["bench", *tiny, "--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["bench", *tiny, "--ctx", "-5"], "--ctx must be >= 1, got -5"),
        (["generate", "--model", "random:tiny", "--prompt", "hi", "--device", "tpu"], "must be cpu, cuda or cuda:N"),
        (["generate", "--model", "random:tiny", "--prompt", "hi", "--budget", "1:32,1:8"], "each batch size once"),
        (["plan", "--model", folders["no-layers"], "--gpus", "1", "--gpu-memory", "80GB"], "lacks 'num_hidden_layers'"),
        (["plan", "--model", folders["text-width"], "--gpus", "1", "--gpu-memory", "80GB"], "must be an integer"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)


def test_config_files_lacking_a_size_are_refused_by_name():
    from ddtree.models.llama import ModelConfig
    from ddtree.speculative.compat import DrafterMismatchError
    from ddtree.speculative.drafter import DrafterConfig

    full = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match=r"config lacks 'num_attention_heads'$"):
        ModelConfig.from_hf(full)
    with pytest.raises(ValueError, match=r"config lacks 'vocab_size' \(and num_attention_heads\)"):
        ModelConfig.from_hf({k: v for k, v in full.items() if k != "vocab_size"})
    drafter = {**full, "num_attention_heads": 4, "architectures": ["DFlashDraftModel"]}
    drafter.pop("num_hidden_layers")
    with pytest.raises(DrafterMismatchError, match="drafter config lacks 'num_hidden_layers'"):
        DrafterConfig.from_hf(drafter)


def test_a_sliding_window_is_where_a_dense_models_context_stops():
    """Sliding-window attention is not implemented in the targets: the window a config asks for (as
    transformers reads it) bounds the requests, so no output is computed past it."""
    from ddtree.models.config_fields import attention_window
    from ddtree.models.llama import ModelConfig
    from ddtree.models.memory import default_max_context, plan_memory
    from ddtree.runtime.build import model_context

    base = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}
    base |= {"num_attention_heads": 4, "max_position_embeddings": 4096}
    cases = [
        ({"model_type": "mistral", "sliding_window": 1024}, 1024),
        ({"model_type": "mistral", "sliding_window": None}, None),
        ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False}, None),
        ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 4}, None),
        ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 2}, 1024),
        (
            {"model_type": "qwen3", "sliding_window": 1024, "use_sliding_window": True},
            None,  # max_window_layers defaults to 28, past these 4 layers
        ),
        (
            {
                "model_type": "qwen3",
                "sliding_window": 1024,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            1024,
        ),
    ]
    for extra, window in cases:
        cfg = {**base, **extra}
        assert attention_window(cfg) == window, extra
        context, why = model_context(ModelConfig.from_hf(cfg))
        assert context == (window or 4096) and ("sliding window" in why) == (window is not None), extra
        assert default_max_context(cfg) == min(2048, window or 4096)
    mistral = {**base, "model_type": "mistral", "sliding_window": 1024}
    plan = plan_memory(mistral, gpus=1, gpu_memory=80 << 30, max_context=2048)
    assert not plan.fits and "more than the model's context of 1,024 tokens" in plan.reason
