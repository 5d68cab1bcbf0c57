"""`bastion demo serve`: the demo pair behind a real SGLang server, one chat request, the BASTION metrics.

Starts `python -m sglang.launch_server --speculative-algorithm BASTION --enable-metrics` on the converted
SmolLM2-135M-Instruct target (`bastion demo setup`) and the drafter committed in
`models/smollm2-135m-instruct-dflash`, on CUDA when torch sees a GPU and on CPU otherwise; waits for
`/health_generate`; sends one chat completion; prints the answer and the `sglang:bastion_*` series of
`/metrics` (`bastion_accept_length` sum / count is the mean accepted length). Then it stops the server, or
keeps it serving with `--keep-serving`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from bastion_sglang.integration.config import CPU_ATTENTION_BACKEND

DEMO_DRAFTER = Path("models") / "smollm2-135m-instruct-dflash"
"""The committed drafter, relative to the repository root."""
DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
CPU_FLAGS = ("--device", "cpu", "--attention-backend", CPU_ATTENTION_BACKEND, "--disable-cuda-graph")
"""Flags that run SGLang on the host: no CUDA graphs, the torch attention backend BASTION extends."""


@dataclass(frozen=True)
class ChatAnswer:
    """One chat completion: the text and its completion tokens."""

    text: str
    completion_tokens: int


def default_drafter() -> Path:
    """The committed drafter: under the current directory, else next to this package's source checkout."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / DEMO_DRAFTER / "config.json").is_file():
            return root / DEMO_DRAFTER
    return Path.cwd() / DEMO_DRAFTER


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def server_command(target: Path, drafter: Path, port: int, device: str, extra: list[str]) -> list[str]:
    """The `launch_server` command line for the demo pair on `device` ("cpu" or "cuda")."""
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target),
        "--speculative-algorithm",
        "BASTION",
        "--speculative-draft-model-path",
        str(drafter),
        "--enable-metrics",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if device == "cpu":
        command += [*CPU_FLAGS, "--mem-fraction-static", "0.2", "--max-total-tokens", "65536"]
    return command + extra


def wait_until_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Poll `url/health_generate` until it answers 200; raise naming the log when the server dies."""
    deadline = time.monotonic() + timeout_s
    with tqdm(desc="starting server", unit="s", bar_format="{desc}: {elapsed}") as bar:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with status {process.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
            bar.update(2)
    raise TimeoutError(f"the server did not become ready within {timeout_s:.0f} s; see {log}")


def chat(url: str, prompt: str, max_tokens: int) -> ChatAnswer:
    """One greedy `/v1/chat/completions` request."""
    body = json.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    return ChatAnswer(
        text=answer["choices"][0]["message"]["content"],
        completion_tokens=int(answer["usage"]["completion_tokens"]),
    )


def bastion_metric_lines(url: str) -> list[str]:
    """The `sglang:bastion_*` samples of `/metrics`, histogram buckets left out."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return [
        line for line in text.splitlines() if line.startswith("sglang:bastion_") and "_bucket{" not in line
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `bastion demo serve`."""
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache directory of `demo setup`")
    parser.add_argument(
        "--draft-model-path",
        type=Path,
        default=None,
        help=f"DFlash drafter (default: the committed {DEMO_DRAFTER})",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when torch sees a GPU"
    )
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat message to send")
    parser.add_argument("--max-tokens", type=int, default=128, help="completion length cap")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the server",
    )
    parser.add_argument("--log", type=Path, default=Path("bastion-demo-server.log"), help="server log file")
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="leave the server running (Ctrl-C stops)",
    )
    parser.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        help="after `--`: more launch_server flags, e.g. -- --bastion-policy chain",
    )


def run(args: argparse.Namespace, target: Path) -> int:
    """Serve the demo pair, send one chat request, print the answer and metrics; exit status 0 on success."""
    drafter = args.draft_model_path or default_drafter()
    if not (drafter / "config.json").is_file():
        print(
            f"error: no DFlash drafter at {drafter} (config.json missing); run from the repository root or "
            "pass --draft-model-path",
            file=sys.stderr,
        )
        return 1
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    extra = [flag for flag in args.server_args if flag != "--"]
    command = server_command(target, drafter, args.port, device, extra)
    url = f"http://127.0.0.1:{args.port}"
    print(f"$ {shlex.join(command)}\n  (log: {args.log})", flush=True)
    with args.log.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_ready(url, process, args.startup_timeout, args.log)
        print(f"\nuser: {args.prompt}", flush=True)
        answer = chat(url, args.prompt, args.max_tokens)
        print(f"assistant: {answer.text}\n({answer.completion_tokens} tokens)\n")
        print("\n".join(bastion_metric_lines(url)), flush=True)
        if args.keep_serving:
            print(f"\nserving at {url} (Ctrl-C stops)", flush=True)
            process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_server(process)
    return 0


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (launch_server, scheduler, detokenizer); SIGKILL after 60 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
