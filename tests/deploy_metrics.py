"""What the deploy tests share: the metric names a BASTION server exports, and readers of the deploy files.

EXPORTED_METRICS: every series name on `/metrics` of a real SGLang 0.5.23 server (tiny CPU target, DFlash
drafter, `--speculative-algorithm BASTION --enable-metrics`) after a few requests. Dashboard panels and
alert rules may name only these (tests/test_deploy_files.py); a live server must still export every one of
them (tests/test_deploy_prometheus.py), so the list cannot drift from the server.

Readers: the PromQL of the Grafana dashboard (with its template variables replaced by values Prometheus
accepts) and of the alert rules, the metric names a PromQL expression selects, the sample names of a
Prometheus text exposition, and the instructions of a Dockerfile.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "bastion.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*", "$instance": ".*", "$dp_rank": ".*"}
"""Grafana template variables of the dashboard and what stands for each when Prometheus runs a query:
the rate window, and "all" for the three regex selectors (`=~`; ".*" also matches a series without the
label, as a server without --dp-size exports)."""

BASTION_METRICS = frozenset(
    {
        "sglang:bastion_accept_length_bucket",
        "sglang:bastion_accept_length_count",
        "sglang:bastion_accept_length_sum",
        "sglang:bastion_expected_accept_length_bucket",
        "sglang:bastion_expected_accept_length_count",
        "sglang:bastion_expected_accept_length_sum",
        "sglang:bastion_latency_ema_factor",
        "sglang:bastion_tree_nodes_bucket",
        "sglang:bastion_tree_nodes_count",
        "sglang:bastion_tree_nodes_sum",
        "sglang:bastion_uncalibrated_steps_total",
        "sglang:bastion_verify_seconds_estimated_bucket",
        "sglang:bastion_verify_seconds_estimated_count",
        "sglang:bastion_verify_seconds_estimated_sum",
        "sglang:bastion_verify_seconds_observed_bucket",
        "sglang:bastion_verify_seconds_observed_count",
        "sglang:bastion_verify_seconds_observed_sum",
        "sglang:bastion_expected_accept_length_raw_bucket",
        "sglang:bastion_expected_accept_length_raw_count",
        "sglang:bastion_expected_accept_length_raw_sum",
        "sglang:bastion_verify_relative_error_bucket",
        "sglang:bastion_verify_relative_error_count",
        "sglang:bastion_verify_relative_error_sum",
        "sglang:bastion_step_stage_seconds_bucket",
        "sglang:bastion_step_stage_seconds_count",
        "sglang:bastion_step_stage_seconds_sum",
        "sglang:bastion_speedup_estimated_bucket",
        "sglang:bastion_speedup_estimated_count",
        "sglang:bastion_speedup_estimated_sum",
        "sglang:bastion_speedup_realised_bucket",
        "sglang:bastion_speedup_realised_count",
        "sglang:bastion_speedup_realised_sum",
        "sglang:bastion_acceptance_calibration_error",
        "sglang:bastion_acceptance_correction",
        "sglang:bastion_decode_steps_total",
    }
)
"""BASTION's own series (bastion_sglang/step/metrics.py), as exposed: histograms as _bucket/_count/_sum."""

SGLANG_METRICS = frozenset(
    {
        "sglang:cache_hit_rate",
        "sglang:cached_tokens_total",
        "sglang:context_len",
        "sglang:cuda_graph_passes_total",
        "sglang:decode_sum_seq_lens",
        "sglang:dp_attention_pairs_total",
        "sglang:dp_attention_steps_total",
        "sglang:dp_attention_sync_wait_seconds_bucket",
        "sglang:dp_attention_sync_wait_seconds_count",
        "sglang:dp_attention_sync_wait_seconds_sum",
        "sglang:dp_attention_token_imbalance_ratio_bucket",
        "sglang:dp_attention_token_imbalance_ratio_count",
        "sglang:dp_attention_token_imbalance_ratio_sum",
        "sglang:dp_attention_tokens_total",
        "sglang:e2e_request_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:e2e_request_latency_seconds_sum",
        "sglang:full_token_usage",
        "sglang:fwd_occupancy",
        "sglang:gen_throughput",
        "sglang:generation_tokens_histogram_bucket",
        "sglang:generation_tokens_histogram_count",
        "sglang:generation_tokens_histogram_sum",
        "sglang:generation_tokens_total",
        "sglang:graph_memory_usage_gb",
        "sglang:http_requests_active",
        "sglang:http_requests_total",
        "sglang:http_responses_total",
        "sglang:is_cuda_graph",
        "sglang:kv_available_tokens",
        "sglang:kv_cache_memory_usage_gb",
        "sglang:kv_evictable_tokens",
        "sglang:kv_used_tokens",
        "sglang:mamba_available_tokens",
        "sglang:mamba_evictable_tokens",
        "sglang:mamba_usage",
        "sglang:mamba_used_tokens",
        "sglang:max_total_num_tokens",
        "sglang:new_token_ratio",
        "sglang:num_decode_deferred_kv_release_reqs",
        "sglang:num_decode_host_receive_queue_reqs",
        "sglang:num_decode_prealloc_queue_reqs",
        "sglang:num_decode_transfer_queue_reqs",
        "sglang:num_grammar_queue_reqs",
        "sglang:num_pages",
        "sglang:num_paused_reqs",
        "sglang:num_prefill_bootstrap_queue_reqs",
        "sglang:num_prefill_inflight_queue_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_requests_total",
        "sglang:num_retracted_reqs",
        "sglang:num_running_reqs",
        "sglang:num_unique_running_routing_keys",
        "sglang:num_used_tokens",
        "sglang:page_size",
        "sglang:pending_prealloc_token_usage",
        "sglang:per_stage_req_latency_seconds_bucket",
        "sglang:per_stage_req_latency_seconds_count",
        "sglang:per_stage_req_latency_seconds_sum",
        "sglang:prealloc_full_token_usage",
        "sglang:prealloc_swa_token_usage",
        "sglang:prefill_effective_tokens_total",
        "sglang:process_cpu_seconds_total",
        "sglang:prompt_tokens_histogram_bucket",
        "sglang:prompt_tokens_histogram_count",
        "sglang:prompt_tokens_histogram_sum",
        "sglang:prompt_tokens_total",
        "sglang:queue_time_seconds_bucket",
        "sglang:queue_time_seconds_count",
        "sglang:queue_time_seconds_sum",
        "sglang:realtime_tokens_total",
        "sglang:request_time_per_output_token_seconds_bucket",
        "sglang:request_time_per_output_token_seconds_count",
        "sglang:request_time_per_output_token_seconds_sum",
        "sglang:routing_key_all_req_count",
        "sglang:routing_key_running_req_count",
        "sglang:routing_keys_active",
        "sglang:scheduler_idle_seconds_total",
        "sglang:scheduler_process_cpu_seconds_total",
        "sglang:scheduler_stage_seconds_total",
        "sglang:spec_accept_length",
        "sglang:spec_accept_rate",
        "sglang:spec_block_accept_length",
        "sglang:spec_cap_length",
        "sglang:spec_num_draft_tokens",
        "sglang:spec_num_steps",
        "sglang:spec_verify_calls_total",
        "sglang:startup_available_gpu_memory_gb",
        "sglang:startup_cuda_graph_time_seconds",
        "sglang:startup_time_seconds",
        "sglang:swa_available_tokens",
        "sglang:swa_evictable_tokens",
        "sglang:swa_token_usage",
        "sglang:swa_used_tokens",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:time_to_first_token_seconds_count",
        "sglang:time_to_first_token_seconds_sum",
        "sglang:token_usage",
        "sglang:uncached_prompt_tokens_histogram_bucket",
        "sglang:uncached_prompt_tokens_histogram_count",
        "sglang:uncached_prompt_tokens_histogram_sum",
        "sglang:utilization",
        "sglang:weight_memory_usage_gb",
    }
)
"""SGLang's own series on the same server."""

EXPORTED_METRICS = BASTION_METRICS | SGLANG_METRICS


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a deploy file: where it is (for messages) and the expression itself."""

    where: str
    expr: str


def _substitute_grafana_variables(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    if "$" in expr:
        raise ValueError(f"unknown Grafana variable in {expr!r}; known: {sorted(GRAFANA_VARIABLES)}")
    return expr


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$", re.DOTALL)


def dashboard_queries() -> list[Query]:
    """Every PromQL of the dashboard: panel targets, and the selectors of its `label_values` variables.

    Grafana variables are replaced by GRAFANA_VARIABLES, so the expressions run as they are in Prometheus.
    """
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = []
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = _LABEL_VALUES.match(variable["query"]["query"])
        if match is None:
            raise ValueError(f"variable {variable['name']}: expected label_values(selector, label)")
        queries.append(
            Query(f"variable {variable['name']}", _substitute_grafana_variables(match["selector"]))
        )
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            queries.append(
                Query(
                    f"panel {panel['title']!r} {target['refId']}",
                    _substitute_grafana_variables(target["expr"]),
                )
            )
    return queries


def alert_queries() -> list[Query]:
    """The expression of every rule in deploy/prometheus/alerts.yml."""
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    return [
        Query(f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in groups
        for rule in group["rules"]
    ]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_OFFSET = re.compile(r"\boffset\s+-?\w+")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "inf", "nan", "Inf", "NaN"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (bare names, and `__name__="..."` matchers).

    Strings, label matchers `{...}`, ranges `[...]`, label lists of by/without/on/ignoring/group_*, offsets
    and function or aggregation names (an identifier followed by "(") are not metric names.
    """
    names = set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))
    stripped = _STRING.sub(" ", expr)
    stripped = _BRACES.sub(" ", stripped)
    stripped = _BRACKETS.sub(" ", stripped)
    stripped = _LABEL_LIST.sub(" ", stripped)
    stripped = _OFFSET.sub(" ", stripped)
    names.update(name for name in _IDENTIFIER.findall(stripped) if name not in _KEYWORDS)
    return names


def exposition_names(text: str) -> set[str]:
    """The sample names of a Prometheus text exposition (comment lines skipped)."""
    return {
        re.split(r"[{\s]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    }


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: the keyword (upper case) and the rest of its line, continuations joined."""

    keyword: str
    arguments: str


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile in order; comments and blank lines dropped."""
    logical, current = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    if current:
        raise ValueError(f"{path}: the last line continues with '\\'")
    instructions = []
    for line in logical:
        keyword, _, arguments = line.strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip()))
    return instructions


def dockerfile_pairs(path: Path, keyword: str) -> dict[str, str]:
    """The KEY=value pairs of every ENV or LABEL instruction of a Dockerfile, later ones winning."""
    pairs: dict[str, str] = {}
    for instruction in dockerfile_instructions(path):
        if instruction.keyword == keyword:
            for word in shlex.split(instruction.arguments):
                key, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"{path}: {keyword} {instruction.arguments!r} is not KEY=value")
                pairs[key] = value
    return pairs


def dockerfile_single(path: Path, keyword: str) -> str:
    """The arguments of the one instruction `keyword` (CMD, HEALTHCHECK, VOLUME, ...) of a Dockerfile."""
    found = [i.arguments for i in dockerfile_instructions(path) if i.keyword == keyword]
    if len(found) != 1:
        raise ValueError(f"{path}: expected one {keyword}, found {len(found)}")
    return found[0]


def healthcheck_command(path: Path) -> str:
    """The shell command of the Dockerfile's HEALTHCHECK (its --options dropped)."""
    _, sep, command = dockerfile_single(path, "HEALTHCHECK").partition(" CMD ")
    if not sep:
        raise ValueError(f"{path}: HEALTHCHECK without CMD")
    return command.strip()
