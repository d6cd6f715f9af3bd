"""hack/check-disk.sh: `make setup` stops before pip when torch's CUDA wheels cannot fit on disk."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "hack" / "check-disk.sh"


def run_check(extras: str, need_gib: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "DDTREE_SETUP_MIN_FREE_GIB": str(need_gib)}
    # A venv python that does not exist: this is a first install.
    return subprocess.run(["bash", str(SCRIPT), "/nonexistent/python", extras],
                          env=env, capture_output=True, text=True)


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
