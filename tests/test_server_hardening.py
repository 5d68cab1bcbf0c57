"""`launch_server --speculative-algorithm BASTION` on CPU under abuse: bad requests, abort storm, KV burst.

One server for the module: the tiny random fp32 target + DFlash drafter of `engine_support.make_model_pair`
(block γ = 16), `--bastion-max-budget 4 --bastion-topk 2` (verify width cap 5 < γ, so a step's KV reserve
is set by the drafter block: 2 x 16 slots per running request), a small KV pool (`--max-total-tokens 640`),
context length 256, and SGLang's strict memory checks on:
- `SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1`: pool accounting (free + evictable + protected + held =
  total) asserted after every scheduler step;
- `SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1` (SGLang's default, set explicitly): the same check plus
  the request-slot pool whenever the scheduler is idle, raising "memory leak detected" instead of warning;
- `SGLANG_CHECK_KV_PAGE_INVARIANTS=1`: after every step, no KV page both owned and free (use-after-free)
  and no page freed twice.
Any failing check kills the scheduler, so "the server still serves and its log has none of those messages"
is the check.

After each scenario (`_assert_whole_and_serving`): no running or waiting request and 0 KV tokens held
(`/v1/loads`); `/flush_cache` succeeds and then the pool is entirely free (held = total - available -
evictable = 0 with evictable 0, so available = max_total_num_tokens = 640); `/health` 200; a new greedy
request returns the non-speculative answer (Hugging Face `generate()` on the same weights); the server
process is alive after 3 s idle (SGLang's idle check ran) and its log has none of FAILURE_PATTERNS.

Scenarios (sizes in the constants below):
- bad requests: negative max_new_tokens, an unknown sampling option, a prompt past the context length,
  prompt + max_new_tokens past it, malformed JSON on /generate and /v1/chat/completions, max_tokens -1 on
  /v1/completions: HTTP 400 with SGLang's own message, the server answering /health after each;
- abort storm: 12 streaming clients (200 new tokens each) close their connection after 3 chunks, and the
  tokens the worker commits meanwhile stay far below 12 x 199 (they were aborted); then 6 streaming and 6
  non-streaming requests are aborted with /abort_request abort_all once all 12 are in the scheduler and a
  token was streamed: all 12 end with finish_reason abort before 200 tokens, the abort counter rises by
  >= 13;
- burst: 32 concurrent requests (16-token prompts, 24 new tokens, half greedy, half T = 0.8 with a seed)
  on the 640-token pool force retraction ("KV cache pool is full. Retract requests" in the log and
  sglang:num_retracted_requests_total rising); every request returns 24 tokens with finish_reason length,
  and the 16 greedy ones equal the non-speculative answer although retracted requests were recomputed.
Statistics print with `pytest -s`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from engine_support import make_model_pair
from sglang_server import CPU_FLAGS, RunningServer, hf_greedy, launch_server, metric_total

pytestmark = pytest.mark.slow

CONTEXT_LENGTH = 256
KV_POOL_TOKENS = 640
BUDGET = 4
PROMPT_TOKENS = 16
CHECK_NEW_TOKENS = 8  # the request sent after each scenario
BURST_REQUESTS = 32
BURST_NEW_TOKENS = 24
DISCONNECTING_CLIENTS = 12
CHUNKS_BEFORE_DISCONNECT = 3
ABORTED_CLIENTS = 6  # streaming, and as many non-streaming
STORM_NEW_TOKENS = 200
WAIT_SECONDS = 120  # longest wait for the scheduler to reach a state (idle, all requests admitted)
STRICT_MEM_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}
FAILURE_PATTERNS = (
    "memory leak detected",  # idle check ("... memory leak detected!")
    "mem leak detected",  # busy check ("Full Pool Mem Leak Detected!")
    "double free",
    "use-after-free",
    "out of memory",
    "scheduler hit an exception",
    "traceback",
)


def prompt(index: int) -> list[int]:
    """A distinct 16-token prompt of byte ids (no shared prefix beyond the first token)."""
    return [(7 * index + 3 * k + 1) % 250 + 1 for k in range(PROMPT_TOKENS)]


CHECK_PROMPT = prompt(999)


@dataclass(frozen=True)
class Served:
    """The module's server and the target folder it serves."""

    server: RunningServer
    target: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("bastion_hardening")
    target, drafter = make_model_pair(root)
    args = [
        "--model-path", str(target),
        "--speculative-algorithm", "BASTION",
        "--speculative-draft-model-path", str(drafter),
        *CPU_FLAGS,
        "--mem-fraction-static", "0.05",
        "--max-total-tokens", str(KV_POOL_TOKENS),
        "--context-length", str(CONTEXT_LENGTH),
        "--enable-metrics",
        "--bastion-max-budget", str(BUDGET),
        "--bastion-topk", "2",
    ]  # fmt: skip
    with launch_server(args, root / "server.log", env=STRICT_MEM_ENV) as running:
        yield Served(running, target)


@pytest.fixture(scope="module")
def check_answer(served: Served) -> list[int]:
    """The non-speculative greedy continuation of CHECK_PROMPT."""
    (answer,) = hf_greedy(served.target, [CHECK_PROMPT], CHECK_NEW_TOKENS)
    return answer


def _generate(server: RunningServer, body: dict) -> dict | list[dict]:
    response = requests.post(f"{server.url}/generate", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def _load(server: RunningServer) -> dict:
    """The scheduler's core load numbers from /v1/loads (num_used_tokens = total - available - evictable)."""
    response = requests.get(f"{server.url}/v1/loads", params={"include": "core"}, timeout=60)
    response.raise_for_status()
    (load,) = response.json()["loads"]
    return load


def _wait_for(server: RunningServer, done: Callable[[dict], bool], what: str) -> dict:
    """Poll /v1/loads every 0.2 s until `done(load)` (at most WAIT_SECONDS); returns that load."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        load = _load(server)
        if done(load):
            return load
        assert time.monotonic() < deadline, f"not {what} after {WAIT_SECONDS} s: {load}"
        time.sleep(0.2)


def _is_idle(load: dict) -> bool:
    return load["num_used_tokens"] == 0 and load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0


def _assert_whole_and_serving(served: Served, check_answer: list[int]) -> None:
    """See the module docstring: idle with 0 KV tokens held, the whole pool free after /flush_cache, /health
    200, a new greedy request equals the non-speculative answer, alive after 3 s idle, a clean log."""
    server = served.server
    _wait_for(server, _is_idle, "idle")
    flushed = requests.post(f"{server.url}/flush_cache", timeout=60)
    assert flushed.status_code == 200, flushed.text
    load = _wait_for(server, _is_idle, "idle after /flush_cache")
    assert load["max_total_num_tokens"] == KV_POOL_TOKENS
    assert requests.get(f"{server.url}/health", timeout=60).status_code == 200
    out = _generate(
        server,
        {
            "input_ids": CHECK_PROMPT,
            "sampling_params": {"max_new_tokens": CHECK_NEW_TOKENS, "temperature": 0.0},
        },
    )
    assert out["output_ids"] == check_answer
    _wait_for(server, _is_idle, "idle after the check request")
    time.sleep(3)  # idle: SGLang's strict idle check runs on every idle scheduler loop
    assert server.alive(), server.log_text()[-4000:]
    log = server.log_text().lower()
    found = [pattern for pattern in FAILURE_PATTERNS if pattern in log]
    assert not found, (found, server.log_text()[-4000:])


# ---------------------------------------------------------------- bad requests


BAD_REQUESTS: list[tuple[str, dict | str, str]] = [
    (
        "/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": -1}},
        "max_new_tokens must be at least 0, got -1.",
    ),
    (
        "/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "bogus_option": 1}},
        "unknown field `bogus_option`",
    ),
    (
        "/generate",
        {"input_ids": [5] * (CONTEXT_LENGTH + 44), "sampling_params": {"max_new_tokens": 4}},
        f"The input ({CONTEXT_LENGTH + 44} tokens) is longer than the model's context length "
        f"({CONTEXT_LENGTH} tokens).",
    ),
    (
        "/generate",
        {"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 100}},
        f"Requested token count exceeds the model's maximum context length of {CONTEXT_LENGTH} tokens.",
    ),
    ("/generate", "{not json", "JSON decode error"),
    ("/v1/chat/completions", '{"messages": [', "JSON decode error"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens must be positive"),
]
"""(path, body or raw text, SGLang's message): negative max_new_tokens, an unknown sampling option, a prompt
past the context length, prompt + max_new_tokens past it, malformed JSON twice, OpenAI max_tokens -1."""


def test_bad_requests_get_sglang_errors(served: Served, check_answer: list[int]) -> None:
    """Each of the 7 bad requests: HTTP 400 whose body carries SGLang's message, and /health stays 200 right
    after; then the full check (pool whole, a new request equals the non-speculative answer, clean log)."""
    server = served.server
    for path, body, message in BAD_REQUESTS:
        data = body if isinstance(body, str) else json.dumps(body)
        response = requests.post(
            f"{server.url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=60
        )
        print(f"\n[bad request] {path} -> {response.status_code} {response.text[:150]}")
        assert response.status_code == 400, (path, response.text)
        assert message in response.text, (path, response.text)
        assert requests.get(f"{server.url}/health", timeout=60).status_code == 200
    _assert_whole_and_serving(served, check_answer)


# ---------------------------------------------------------------- abort storm


def _stream_then_disconnect(server: RunningServer, index: int) -> int:
    """Stream a 200-token generation, read CHUNKS_BEFORE_DISCONNECT data chunks, then close the connection.
    Returns the chunks read."""
    body = {
        "input_ids": prompt(index),
        "sampling_params": {"max_new_tokens": STORM_NEW_TOKENS, "ignore_eos": True, "temperature": 0.7},
        "stream": True,
    }
    read = 0
    with requests.Session() as session:
        response = session.post(f"{server.url}/generate", json=body, stream=True, timeout=600)
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                read += 1
                if read == CHUNKS_BEFORE_DISCONNECT:
                    break
        response.close()
    return read


def _stream_to_end(server: RunningServer, index: int, started: threading.Event) -> dict:
    """Stream a 200-token greedy generation until the server ends it; sets `started` at the first chunk;
    returns the last JSON chunk."""
    body = {
        "input_ids": prompt(index),
        "sampling_params": {"max_new_tokens": STORM_NEW_TOKENS, "ignore_eos": True, "temperature": 0.0},
        "stream": True,
    }
    last: dict = {}
    with requests.post(f"{server.url}/generate", json=body, stream=True, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                last = json.loads(line[len(b"data: ") :])
                started.set()
    return last


def test_abort_storm_frees_every_slot(served: Served, check_answer: list[int]) -> None:
    """12 streaming clients disconnect after 3 chunks each: the worker commits < 12 x 199 / 2 tokens for
    them (200 each if they were not aborted) and the pool empties. Then 6 streaming and 6 non-streaming
    requests are aborted by abort_all once all 12 are in the scheduler and one stream produced a token: all
    12 finish with 'abort' before their 200 tokens; the abort counter rises by >= 13. The pool is whole, the
    server serves the non-speculative answer and the checks stay silent."""
    server = served.server
    aborts_before = metric_total(server.url, "sglang:num_aborted_requests_total")
    committed_before = metric_total(server.url, "sglang:bastion_accept_length_sum")
    with ThreadPoolExecutor(DISCONNECTING_CLIENTS) as pool:
        dropped = list(pool.map(lambda i: _stream_then_disconnect(server, i), range(DISCONNECTING_CLIENTS)))
    assert dropped == [CHUNKS_BEFORE_DISCONNECT] * DISCONNECTING_CLIENTS
    _wait_for(server, _is_idle, "idle after the disconnects")
    committed = metric_total(server.url, "sglang:bastion_accept_length_sum") - committed_before
    assert committed < DISCONNECTING_CLIENTS * (STORM_NEW_TOKENS - 1) / 2, committed

    started = threading.Event()
    everyone = 2 * ABORTED_CLIENTS
    with ThreadPoolExecutor(everyone) as pool:
        streamed = [pool.submit(_stream_to_end, server, 100 + i, started) for i in range(ABORTED_CLIENTS)]
        plain = [
            pool.submit(
                _generate,
                server,
                {
                    "input_ids": prompt(200 + i),
                    "sampling_params": {
                        "max_new_tokens": STORM_NEW_TOKENS,
                        "ignore_eos": True,
                        "temperature": 0.9,
                    },
                },
            )
            for i in range(ABORTED_CLIENTS)
        ]
        admitted = _wait_for(
            server,
            lambda load: started.is_set() and load["num_running_reqs"] + load["num_waiting_reqs"] == everyone,
            "holding all 12 requests",
        )
        requests.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=60).raise_for_status()
        results = [future.result() for future in streamed + plain]
    reasons = [result["meta_info"]["finish_reason"]["type"] for result in results]
    generated = [result["meta_info"]["completion_tokens"] for result in results]
    _wait_for(server, _is_idle, "idle after abort_all")
    aborts = metric_total(server.url, "sglang:num_aborted_requests_total") - aborts_before
    print(
        f"\n[abort storm] {DISCONNECTING_CLIENTS} disconnects: {committed:.0f} tokens committed for them "
        f"(limit {DISCONNECTING_CLIENTS * (STORM_NEW_TOKENS - 1) / 2:.0f}); abort_all with "
        f"{admitted['num_running_reqs']} running + {admitted['num_waiting_reqs']} waiting: finish reasons "
        f"{reasons}, tokens before abort {generated}; abort counter +{aborts:.0f}"
    )
    assert reasons == ["abort"] * everyone, results
    assert all(n < STORM_NEW_TOKENS for n in generated) and max(generated) > 0
    assert aborts >= DISCONNECTING_CLIENTS + 1
    _assert_whole_and_serving(served, check_answer)


# ---------------------------------------------------------------- burst with retraction


def _burst_body(index: int) -> dict:
    """Even index: greedy; odd: T = 0.8 with a per-request sampling_seed."""
    params: dict = {"max_new_tokens": BURST_NEW_TOKENS, "ignore_eos": True, "temperature": 0.0}
    if index % 2:
        params |= {"temperature": 0.8, "sampling_seed": 1000 + index}
    return {"input_ids": prompt(300 + index), "sampling_params": params}


def test_burst_on_small_pool_retracts_and_completes(served: Served, check_answer: list[int]) -> None:
    """32 concurrent requests on the 640-token pool: SGLang retracts (its log line and its counter), every
    request still returns exactly 24 tokens with finish_reason length, the 16 greedy ones equal the
    non-speculative answer, and the pool is whole afterwards."""
    server = served.server
    retracted_before = metric_total(server.url, "sglang:num_retracted_requests_total")
    retract_lines_before = server.log_text().count("KV cache pool is full. Retract requests.")
    results: list[dict] = [{}] * BURST_REQUESTS
    start = threading.Barrier(BURST_REQUESTS)

    def one(index: int) -> None:
        start.wait()
        out = _generate(server, _burst_body(index))
        assert isinstance(out, dict)
        results[index] = out

    began = time.monotonic()
    with ThreadPoolExecutor(BURST_REQUESTS) as pool:
        list(pool.map(one, range(BURST_REQUESTS)))
    seconds = time.monotonic() - began
    retracted = metric_total(server.url, "sglang:num_retracted_requests_total") - retracted_before
    retract_lines = server.log_text().count("KV cache pool is full. Retract requests.") - retract_lines_before
    print(
        f"\n[burst] {BURST_REQUESTS} requests x {BURST_NEW_TOKENS} tokens, {KV_POOL_TOKENS}-token pool, "
        f"{seconds:.1f} s; retracted requests {retracted:.0f}, retraction log lines {retract_lines}"
    )
    assert retract_lines >= 1 and retracted >= 1
    assert [len(r["output_ids"]) for r in results] == [BURST_NEW_TOKENS] * BURST_REQUESTS
    assert {r["meta_info"]["finish_reason"]["type"] for r in results} == {"length"}
    greedy = range(0, BURST_REQUESTS, 2)
    reference = hf_greedy(served.target, [prompt(300 + i) for i in greedy], BURST_NEW_TOKENS)
    assert [results[i]["output_ids"] for i in greedy] == reference
    _assert_whole_and_serving(served, check_answer)
