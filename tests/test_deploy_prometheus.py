"""The monitoring stack against real parts: an SGLang CPU server, the `prometheus` server, `promtool`.

promtool checks deploy/prometheus/prometheus.yml and alerts.yml and runs the alert unit tests
(alerts.test.yml). One SGLang server for the module, launched by the Dockerfile's own CMD and HEALTHCHECK
(with the CPU image's flags, a tiny random target and DFlash drafter from tests/tiny_models.py, an empty
profile store, on a free loopback port): it must export every name of `deploy_metrics.EXPORTED_METRICS`.
One Prometheus, with the deploy scrape config and alert rules pointed at that port (1 s scrapes): it must
store the budget histogram under its exported name, run every dashboard query with a non-empty answer,
load the alert rules, and hold BastionProfileMissing pending (the server has no profile).

promtool and prometheus come from the Debian package `prometheus` (.ci/run installs it); without them those
tests skip, and fail under CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from deploy_metrics import (
    ALERTS,
    DEPLOY,
    EXPORTED_METRICS,
    alert_queries,
    dashboard_queries,
    dockerfile_pairs,
    dockerfile_single,
    exposition_names,
    healthcheck_command,
    metric_names,
)

PROMETHEUS_DIR = DEPLOY / "prometheus"
STARTUP_SECONDS = 400
SCRAPE_SECONDS = 90
"""Longest wait for Prometheus to be ready, to scrape, or to evaluate the rules."""
PROMPTS = [list(b"hello world"), list(b"the quick brown fox"), list(b"BASTION serves")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian: apt-get install -y prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; .ci/run installs it")
        pytest.skip(message)
    return path


def _wait_for(what: str, check: Callable[[], Any], seconds: float, log: Path | None = None) -> Any:
    """Call `check` until it returns a truthy value (returned) or `seconds` pass (test failure)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            result = check()
        except requests.ConnectionError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            tail = f":\n{log.read_text()[-4000:]}" if log is not None and log.exists() else ""
            pytest.fail(f"{what} not seen after {seconds} s{tail}")
        time.sleep(1)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group started with `process`, then SIGKILL it if it is still there after 60 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)


# ---- promtool on the deploy files ----------------------------------------------------------------


def test_promtool_accepts_the_scrape_config_and_rules() -> None:
    promtool = _tool("promtool")
    for command in (
        [promtool, "check", "config", "prometheus.yml"],
        [promtool, "check", "rules", "alerts.yml"],
    ):
        result = subprocess.run(command, cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_pass_their_unit_tests() -> None:
    """alerts.test.yml: each alert fires for its case after its `for` and stays quiet for the near miss."""
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", "alerts.test.yml"],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- a live server and a live Prometheus ---------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(URL, port) of an SGLang server started with the Dockerfile's CMD and the CPU image's settings."""
    from tiny_models import make_tiny_drafter, make_tiny_target

    root = tmp_path_factory.mktemp("deploy_server")
    target = make_tiny_target(root / "target", vocab_size=260, initializer_range=0.1)
    drafter = make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2])
    (store := root / "profiles").mkdir()
    cpu_env = dockerfile_pairs(DEPLOY / "Dockerfile.cpu", "ENV")
    port = _free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this venv
        "MODEL_PATH": str(target),
        "DRAFT_MODEL_PATH": str(drafter),
        "ATTENTION_BACKEND": cpu_env["ATTENTION_BACKEND"],
        "HOST": "127.0.0.1",
        "PORT": str(port),
        # A small KV pool on a shared CI machine; the rest are the CPU image's flags.
        "SERVER_ARGS": f"{cpu_env['SERVER_ARGS']} --max-total-tokens 8192",
        "BASTION_PROFILE_STORE": str(store),
    }
    command = json.loads(dockerfile_single(DEPLOY / "Dockerfile", "CMD"))
    log = root / "server.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        return requests.get(f"{url}/health_generate", timeout=30).status_code == 200

    try:
        _wait_for("server /health_generate", ready, STARTUP_SECONDS, log)
        yield url, port
    finally:
        _stop(process)


def _generate(url: str) -> None:
    """A greedy batch, a sampled batch and an OpenAI completion: every decode path adds to the series."""
    for params in (
        {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
        {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True},
    ):
        response = requests.post(
            f"{url}/generate", json={"input_ids": PROMPTS, "sampling_params": params}, timeout=300
        )
        response.raise_for_status()
    model = requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    completion = {"model": model, "prompt": "hello", "max_tokens": 8, "temperature": 0.5}
    requests.post(f"{url}/v1/completions", json=completion, timeout=300).raise_for_status()


@pytest.mark.slow
def test_docker_healthcheck_passes_on_the_server_and_fails_without_it(server: tuple[str, int]) -> None:
    check = ["sh", "-c", healthcheck_command(DEPLOY / "Dockerfile")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    up = subprocess.run(check, env={**env, "PORT": str(server[1])}, capture_output=True, timeout=60)
    assert up.returncode == 0, up.stderr
    down = subprocess.run(check, env={**env, "PORT": str(_free_port())}, capture_output=True, timeout=60)
    assert down.returncode != 0


@pytest.mark.slow
def test_server_exports_every_listed_metric(server: tuple[str, int]) -> None:
    url, _ = server
    _generate(url)
    exported = exposition_names(requests.get(f"{url}/metrics", timeout=60).text)
    assert exported >= EXPORTED_METRICS, f"listed but not exported: {sorted(EXPORTED_METRICS - exported)}"
    used = set().union(*(metric_names(q.expr) for q in dashboard_queries() + alert_queries()))
    assert used <= exported


@pytest.fixture(scope="module")
def prometheus(server: tuple[str, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Prometheus running deploy/prometheus/prometheus.yml against the server, after it has
    scraped the server at least once and the server has served requests since (counters increase)."""
    binary = _tool("prometheus")
    url, port = server
    root = tmp_path_factory.mktemp("deploy_prometheus")
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    (root / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    web_port = _free_port()
    log = root / "prometheus.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{web_port}",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = f"http://127.0.0.1:{web_port}"
    try:
        _wait_for(
            "Prometheus ready", lambda: requests.get(f"{api}/-/ready", timeout=10).ok, SCRAPE_SECONDS, log
        )
        _wait_for("a scrape of the server", lambda: _query(api, "up == 1"), SCRAPE_SECONDS, log)
        _generate(url)
        yield api
    finally:
        _stop(process)


def _query(api: str, expr: str) -> list[dict[str, Any]]:
    """The result vector of an instant query; a query Prometheus rejects fails the test."""
    body = requests.get(f"{api}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", f"{expr!r}: {body.get('error')}"
    return body["data"]["result"]


@pytest.mark.slow
def test_prometheus_stores_the_budget_histogram(prometheus: str) -> None:
    result = _wait_for(
        "sglang:bastion_tree_nodes_count > 0",
        lambda: _query(prometheus, "sglang:bastion_tree_nodes_count > 0"),
        SCRAPE_SECONDS,
    )
    (sample,) = result
    assert sample["metric"]["job"] == "bastion-sglang"
    stored = set(requests.get(f"{prometheus}/api/v1/label/__name__/values", timeout=30).json()["data"])
    used = set().union(*(metric_names(q.expr) for q in dashboard_queries() + alert_queries()))
    assert used <= stored, f"not stored under the exported name: {sorted(used - stored)}"


@pytest.mark.slow
def test_every_dashboard_query_answers(prometheus: str) -> None:
    for query in dashboard_queries():
        _wait_for(query.where, lambda expr=query.expr: _query(prometheus, expr), SCRAPE_SECONDS)


@pytest.mark.slow
def test_alert_rules_run_and_the_missing_profile_is_noticed(prometheus: str) -> None:
    def groups() -> list[dict[str, Any]]:
        return requests.get(f"{prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"]

    def profile_missing() -> dict[str, Any] | None:
        (group,) = groups()
        rule = next(rule for rule in group["rules"] if rule["name"] == "BastionProfileMissing")
        return rule if rule["state"] in ("pending", "firing") else None

    rule = _wait_for("BastionProfileMissing pending", profile_missing, SCRAPE_SECONDS)
    assert rule["alerts"][0]["labels"]["instance"].startswith("127.0.0.1:")
    (group,) = groups()
    assert {r["name"] for r in group["rules"]} == {q.where.removeprefix("rule ") for q in alert_queries()}
    for r in group["rules"]:
        assert r["health"] == "ok", (r["name"], r.get("lastError"))
