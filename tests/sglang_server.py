"""Start and stop `python -m sglang.launch_server` for tests, and read what it serves.

Shared by the HTTP server tests on CPU (`test_sglang_server.py`, `test_server_hardening.py`) and on CUDA
(`gpu/test_sglang_cuda.py`). `launch_server`: the server runs in its own process group, writes stdout and
stderr to `log`, and is ready when `/health_generate` answers 200 (a real generation passed through the
scheduler). `generate_greedy` makes one greedy /generate call; `metric_values` / `metric_total` read
`/metrics` (Prometheus text); `hf_greedy` is the non-speculative answer the servers are compared with
(Hugging Face `generate()` on the same fp32 weights).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--dtype", "float32",
    "--sleep-on-idle",
)  # fmt: skip
"""What every CPU server in the tests passes: fp32 keeps CPU runs exact; an idle scheduler otherwise polls
its sockets without pause and holds a whole core, which the test's own process needs on two cores."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RunningServer:
    """A launched server: its base URL, its process (own process group) and its log file."""

    url: str
    process: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None


STARTUP_POLL_SECONDS = 0.5
"""Between health checks of a starting server: a refused connection costs nothing, and a server that is up
waits at most this long for its first test."""


@contextmanager
def launch_server(
    args: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    startup_seconds: float = 400,
    stop_seconds: float = 60,
) -> Iterator[RunningServer]:
    """Run `python -m sglang.launch_server ARGS --host 127.0.0.1 --port P` until the block ends.

    args: the server flags (model, backend, ...), without host and port. env: variables added to this
    process's environment (e.g. SGLang's strict memory checks). Fails the test, with the log's tail, if the
    server exits or is not ready within `startup_seconds`; on exit sends SIGTERM to the process group.
    """
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        *args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    server = RunningServer(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + startup_seconds
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{server.log_text()[-4000:]}")
            try:
                if requests.get(f"{server.url}/health_generate", timeout=30).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {startup_seconds} s:\n{server.log_text()[-4000:]}")
            time.sleep(STARTUP_POLL_SECONDS)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=stop_seconds)


def metric_values(text: str, name: str) -> list[tuple[str, float]]:
    """(label block, value) of every sample of `name` in a Prometheus text exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return [(labels or "", float(value)) for labels, value in pattern.findall(text)]


def metric_total(url: str, name: str) -> float:
    """Sum over label sets of one series on the server's /metrics (0 when absent)."""
    text = requests.get(f"{url}/metrics", timeout=60).text
    return sum(value for _, value in metric_values(text, name))


def generate_greedy(
    url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, timeout: float = 300
) -> list[list[int]]:
    """Output ids of one greedy /generate call for `prompts` (ignore_eos: exactly max_new_tokens each)."""
    response = requests.post(
        f"{url}/generate",
        json={
            "input_ids": [list(prompt) for prompt in prompts],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        },
        timeout=timeout,
    )
    response.raise_for_status()
    return [out["output_ids"] for out in response.json()]


def hf_greedy(target: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts` (one at a time) by the Hugging Face model on the fp32 target folder:
    what a server without speculation returns for them with ignore_eos. The argmax runs over the whole
    vocabulary, EOS included: SGLang's ignore_eos only keeps going after an EOS, whereas `generate()`'s
    min_new_tokens would mask EOS and pick the runner-up."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            step_ids, cache, tokens = torch.tensor([list(prompt)]), None, []
            for _ in range(max_new_tokens):
                result = model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                cache = result.past_key_values
                tokens.append(int(result.logits[0, -1].argmax()))
                step_ids = torch.tensor([[tokens[-1]]])
            outputs.append(tokens)
    return outputs
