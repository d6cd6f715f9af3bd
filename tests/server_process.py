"""A `python -m ddtree serve` subprocess on loopback and plain-HTTP helpers for the server tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ddtree.serving.metrics import read_samples

MODEL = "smollm2-135m-instruct"
# One torch thread per server: on a small shared CI machine, OpenMP threads of several busy processes
# fighting over the same cores are several times slower than one thread each.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def http(method: str, url: str, body=None, timeout: float = 120.0, headers=None) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def metrics(url: str) -> dict:
    status, text = http("GET", url + "/metrics")
    assert status == 200
    return read_samples(text)


def assert_openai_error(status: int, body, expected_status: int, needle: str = "") -> None:
    assert status == expected_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert needle.lower() in body["error"]["message"].lower(), body


class Server:
    """A `python -m ddtree serve` subprocess on a free 127.0.0.1 port (--port 0)."""

    def __init__(self, args: list[str], log_path, env: dict | None = None):
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - open for the life of the process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddtree",
                "serve",
                "--model",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**ENV, **(env or {})},
        )
        self.started = time.monotonic()
        deadline = time.monotonic() + 120
        while True:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.output(10**9))
            if m:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not start:\n{self.output()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{m[1]}"

    def output(self, tail: int = 6000) -> str:
        with open(self.log_path) as f:
            return f.read()[-tail:]

    def wait_ready(self, timeout: float = 300.0) -> list[tuple[int, int]]:
        """Poll /health and /ready until ready; returns the (health, ready) statuses seen."""
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.output()}"
            seen.append((http("GET", self.url + "/health")[0], http("GET", self.url + "/ready")[0]))
            if seen[-1][1] == 200:
                return seen
            time.sleep(0.2)
        raise AssertionError(f"not ready after {timeout}s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
