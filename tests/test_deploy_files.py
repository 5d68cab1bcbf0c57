"""The deploy files agree with each other, with the repository and with what the server exports.

Compose, Kubernetes and Grafana provisioning files parse; every file they point at exists; they run the
image the Dockerfile builds, on the port it exposes, with the profile store where it keeps it; the two
Dockerfiles launch the server the same way; the Prometheus Operator objects equal the plain Prometheus
files; the dashboard has a query in every panel and covers every BASTION series; the dashboard and the
alert rules name only metrics a live server exports (`deploy_metrics.EXPORTED_METRICS`, checked against a
live server by tests/test_deploy_prometheus.py). The built-in Kubernetes objects validate, strictly, against
the Kubernetes OpenAPI schema (kubernetes-validate).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_metrics import (
    BASTION_METRICS,
    DASHBOARD,
    DEPLOY,
    EXPORTED_METRICS,
    REPO,
    alert_queries,
    dashboard_queries,
    dockerfile_instructions,
    dockerfile_pairs,
    dockerfile_single,
    healthcheck_command,
    metric_names,
)

DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERFILE_CPU = DEPLOY / "Dockerfile.cpu"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_CPU = DEPLOY / "compose.cpu.yaml"
K8S = DEPLOY / "k8s"
K8S_MULTI_GPU = DEPLOY / "k8s-multi-gpu"
"""The tensor-parallel variant: a kustomize overlay of K8S (one pod, --tp-size over its GPUs)."""
KUSTOMIZATIONS = (K8S, K8S / "calibrate")
"""The server with its monitoring objects, and the calibration Job (applied on its own)."""
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
PROVISIONING = DEPLOY / "grafana" / "provisioning"


@dataclass(frozen=True)
class ComposeTag:
    """A Compose merge tag (`!reset`, `!override`) and the value it carries."""

    tag: str
    value: Any


class _ComposeLoader(yaml.SafeLoader):
    """YAML loader that also reads Compose's merge tags."""


def _construct_tag(loader: yaml.SafeLoader, node: yaml.Node) -> ComposeTag:
    if isinstance(node, yaml.MappingNode):
        value: Any = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        plain = yaml.ScalarNode(loader.resolve(yaml.ScalarNode, node.value, (True, False)), node.value)
        value = loader.construct_object(plain)
    return ComposeTag(node.tag, value)


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, _construct_tag)


def _compose(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_ComposeLoader)


_MOUNT = re.compile(r"^(?P<source>\$\{[^}]*\}|[^:]+):(?P<target>[^:]+)(?::(?P<mode>ro|rw))?$")


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """source -> target of a Compose service's short-syntax volumes (a source may be `${VAR:-default}`)."""
    mounts = {}
    for entry in service.get("volumes", []):
        match = _MOUNT.match(entry)
        assert match is not None, f"unreadable volume entry {entry!r}"
        mounts[match["source"]] = match["target"]
    return mounts


def _yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def _k8s_objects() -> dict[str, dict[str, Any]]:
    """kind -> object, from the files the two kustomizations list (one object of each kind)."""
    objects: dict[str, dict[str, Any]] = {}
    for folder in KUSTOMIZATIONS:
        for resource in _yaml_documents(folder / "kustomization.yaml")[0]["resources"]:
            for doc in _yaml_documents(folder / resource):
                assert doc["kind"] not in objects, f"two {doc['kind']} objects"
                objects[doc["kind"]] = doc
    return objects


def _image() -> str:
    """The image name the Dockerfile's labels give: <title>:<version>."""
    labels = dockerfile_pairs(DOCKERFILE, "LABEL")
    return f"{labels['org.opencontainers.image.title']}:{labels['org.opencontainers.image.version']}"


def _port() -> int:
    (exposed,) = dockerfile_single(DOCKERFILE, "EXPOSE").split()
    return int(exposed)


def _profile_store() -> str:
    return dockerfile_pairs(DOCKERFILE, "ENV")["BASTION_PROFILE_STORE"]


# ---- Dockerfiles ---------------------------------------------------------------------------------


def test_dockerfile_pins_the_sglang_image_and_version_of_pyproject() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (sglang_pin,) = [dep for dep in project["optional-dependencies"]["sglang"] if dep.startswith("sglang")]
    version = sglang_pin.split("==")[1]
    args = [i.arguments for i in dockerfile_instructions(DOCKERFILE) if i.keyword == "ARG"]
    assert f"SGLANG_IMAGE=lmsysorg/sglang:v{version}" in args
    assert dockerfile_single(DOCKERFILE, "FROM") == "${SGLANG_IMAGE}"
    assert f"sglang.__version__ == '{version}'" in dockerfile_single(DOCKERFILE, "RUN")
    for dockerfile in (DOCKERFILE, DOCKERFILE_CPU):
        assert dockerfile_pairs(dockerfile, "LABEL")["org.opencontainers.image.version"] == project["version"]


def test_gpu_and_cpu_images_launch_the_server_the_same_way() -> None:
    command = json.loads(dockerfile_single(DOCKERFILE, "CMD"))
    assert command[:2] == ["sh", "-c"]
    script = command[2]
    for flag in ("--speculative-algorithm BASTION", "--enable-metrics", '--port "$PORT"', "$SERVER_ARGS"):
        assert flag in script
    assert script.startswith("exec python3 -m sglang.launch_server ")
    for keyword in ("CMD", "EXPOSE", "VOLUME"):
        assert dockerfile_single(DOCKERFILE_CPU, keyword) == dockerfile_single(DOCKERFILE, keyword)
    assert healthcheck_command(DOCKERFILE_CPU) == healthcheck_command(DOCKERFILE)
    assert "/health" in healthcheck_command(DOCKERFILE)
    gpu, cpu = dockerfile_pairs(DOCKERFILE, "ENV"), dockerfile_pairs(DOCKERFILE_CPU, "ENV")
    assert gpu["PORT"] == cpu["PORT"] == str(_port())
    assert gpu["BASTION_PROFILE_STORE"] == cpu["BASTION_PROFILE_STORE"]
    assert json.loads(dockerfile_single(DOCKERFILE, "VOLUME")) == [gpu["BASTION_PROFILE_STORE"]]
    assert gpu["ATTENTION_BACKEND"] in ("triton", "flashinfer")
    assert cpu["ATTENTION_BACKEND"] == "torch_native"
    for flag in ("--device cpu", "--disable-cuda-graph", "--dtype float32", "--mem-fraction-static 0.2"):
        assert flag in cpu["SERVER_ARGS"]


def test_cpu_image_serves_the_demo_target_and_the_committed_drafter() -> None:
    env = dockerfile_pairs(DOCKERFILE_CPU, "ENV")
    runs = [i.arguments for i in dockerfile_instructions(DOCKERFILE_CPU) if i.keyword == "RUN"]
    assert f'test "$(bastion demo setup --print-path)" = {env["MODEL_PATH"]}' in runs
    assert env["MODEL_PATH"] == f"{env['XDG_CACHE_HOME']}/bastion-sglang/smollm2-135m-instruct"
    workdir = dockerfile_single(DOCKERFILE_CPU, "WORKDIR")
    drafter = Path(env["DRAFT_MODEL_PATH"]).relative_to(workdir)
    assert (REPO / drafter / "config.json").is_file(), f"the demo drafter {drafter} is not in the repository"
    assert "COPY models ./models" in [f"COPY {i.arguments}" for i in dockerfile_instructions(DOCKERFILE_CPU)]


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE_CPU], ids=lambda p: p.name)
def test_dockerfile_copies_existing_paths_its_dockerignore_lets_through(dockerfile: Path) -> None:
    """BuildKit reads <Dockerfile>.dockerignore: everything is excluded except the paths the build copies."""
    ignore = [
        line.strip()
        for line in dockerfile.with_name(dockerfile.name + ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*"
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    copied = set()
    for instruction in dockerfile_instructions(dockerfile):
        if instruction.keyword == "COPY":
            *sources, _ = instruction.arguments.split()
            copied.update(sources)
    assert copied == allowed
    for source in copied - {"models"}:
        assert (REPO / source).exists(), source


# ---- Compose -------------------------------------------------------------------------------------


def test_compose_runs_the_dockerfile_image_with_gpu_port_and_profile_store() -> None:
    compose = _compose(COMPOSE)
    server = compose["services"]["server"]
    assert server["image"] == _image()
    build = server["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == REPO
    assert (REPO / build["dockerfile"]).resolve() == DOCKERFILE
    assert server["ports"] == [f"{_port()}:{_port()}"]
    sources = {target: source for source, target in _mounts(server).items()}
    assert sources[_profile_store()] in compose["volumes"], "the profile store must be a named volume"
    (device,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert {"MODEL_PATH", "DRAFT_MODEL_PATH"} <= set(server["environment"])


def test_compose_cpu_override_builds_the_cpu_image_without_gpu() -> None:
    server = _compose(COMPOSE_CPU)["services"]["server"]
    assert server["image"] == f"{_image()}-cpu"
    assert (REPO / server["build"]["dockerfile"]).resolve() == DOCKERFILE_CPU
    assert server["deploy"] == ComposeTag("!reset", None)
    assert set(server) == {"image", "build", "deploy"}, "everything else comes from compose.yaml"


def test_compose_bind_mounts_exist_and_prometheus_scrapes_the_server() -> None:
    compose = _compose(COMPOSE)
    for name, service in compose["services"].items():
        for source in _mounts(service):
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source}"
    prometheus = compose["services"]["prometheus"]
    mounts = _mounts(prometheus)
    config_path = mounts["./prometheus/prometheus.yml"]
    assert f"--config.file={config_path}" in prometheus["command"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for rule_file in config["rule_files"]:
        assert mounts[f"./prometheus/{rule_file}"] == str(Path(config_path).parent / rule_file)
    (job,) = config["scrape_configs"]
    (targets,) = [static["targets"] for static in job["static_configs"]]
    assert targets == [f"server:{_port()}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_grafana_provisioning_loads_the_dashboard_from_prometheus() -> None:
    grafana = _compose(COMPOSE)["services"]["grafana"]
    mounts = _mounts(grafana)
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard_file = Path(mounts["./grafana/bastion.json"])
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "bastion.yml").read_text())["providers"]
    assert Path(provider["options"]["path"]) == dashboard_file.parent
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == str(dashboard_file)
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == datasource["uid"]


# ---- Kubernetes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_kustomization_lists_every_manifest_and_sets_the_image(folder: Path) -> None:
    kustomization = _yaml_documents(folder / "kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    assert listed == {path.name for path in folder.glob("*.yaml")} - {"kustomization.yaml"}
    (image,) = kustomization["images"]
    assert f"{image['name']}:{image['newTag']}" == _image()


BUILT_IN_KINDS = ("ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Job")
MANIFESTS = [path for folder in KUSTOMIZATIONS for path in sorted(folder.glob("*.yaml"))]


@pytest.mark.parametrize(
    "manifest",
    [
        path
        for folder in KUSTOMIZATIONS
        for path in sorted(folder.glob("*.yaml"))
        if path.name != "kustomization.yaml"
    ],
    ids=lambda p: str(p.relative_to(DEPLOY)),
)
def test_built_in_objects_validate_against_the_kubernetes_schema(manifest: Path) -> None:
    version = kubernetes_validate.latest_version()
    for document in _yaml_documents(manifest):
        if document["kind"] in BUILT_IN_KINDS:
            kubernetes_validate.validate(document, version, strict=True)
        else:
            assert document["apiVersion"] == "monitoring.coreos.com/v1", manifest


def test_the_schema_check_rejects_a_malformed_deployment() -> None:
    deployment = _k8s_objects()["Deployment"]
    broken = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="'two' is not of type 'integer'"):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_k8s_server_and_calibrate_job_share_image_config_and_profile_store() -> None:
    objects = _k8s_objects()
    config_map = objects["ConfigMap"]
    claim = objects["PersistentVolumeClaim"]["metadata"]["name"]
    pods = {
        "Deployment": objects["Deployment"]["spec"]["template"]["spec"],
        "Job": objects["Job"]["spec"]["template"]["spec"],
    }
    for kind, pod in pods.items():
        (container,) = pod["containers"]
        assert container["image"] == _image(), kind
        assert container["envFrom"] == [{"configMapRef": {"name": config_map["metadata"]["name"]}}], kind
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, kind
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        assert volumes[mounts[_profile_store()]]["persistentVolumeClaim"]["claimName"] == claim, kind
    assert {"MODEL_PATH", "DRAFT_MODEL_PATH", "ATTENTION_BACKEND"} <= set(config_map["data"])
    (job,) = pods["Job"]["containers"]
    assert job["command"][:2] == ["bastion", "calibrate"]
    for flag, value in (
        ("--model-path", "$(MODEL_PATH)"),
        ("--draft-model-path", "$(DRAFT_MODEL_PATH)"),
        ("--engine", "sglang"),
        ("--attention-backend", "$(ATTENTION_BACKEND)"),
    ):
        assert job["command"][job["command"].index(flag) + 1] == value
    assert pods["Job"]["restartPolicy"] == "Never"


def test_k8s_server_probes_health_on_the_exposed_port_behind_the_service() -> None:
    objects = _k8s_objects()
    deployment = objects["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": _port()}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    service = objects["Service"]["spec"]
    assert service["selector"].items() <= pod_labels.items()
    assert service["ports"] == [{"name": "http", "port": _port(), "targetPort": "http"}]
    monitor = objects["PodMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")


def _strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge for what the overlay patches: maps merge key by key, lists of named
    objects (containers, volumes) merge by name, anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = _strategic_merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and all("name" in item for item in base + patch):
        by_name = {item["name"]: item for item in base}
        for item in patch:
            by_name[item["name"]] = _strategic_merge(by_name.get(item["name"], {}), item)
        return list(by_name.values())
    return patch


def _multi_gpu_objects() -> dict[str, dict[str, Any]]:
    """kind -> object of the multi-GPU overlay: the server objects of K8S with the overlay's patches."""
    kustomization = _yaml_documents(K8S_MULTI_GPU / "kustomization.yaml")[0]
    assert kustomization["resources"] == ["../k8s"]
    objects = {kind: obj for kind, obj in _k8s_objects().items() if kind != "Job"}
    for entry in kustomization["patches"]:
        (patch,) = _yaml_documents(K8S_MULTI_GPU / entry["path"])
        base = objects[patch["kind"]]
        assert base["metadata"]["name"] == patch["metadata"]["name"], entry["path"]
        objects[patch["kind"]] = _strategic_merge(base, patch)
    return objects


def _resource_quantity(value: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    text = str(value)
    return float(text[:-2]) * units[text[-2:]] if text[-2:] in units else float(text)


def test_k8s_multi_gpu_variant_gives_the_pod_one_gpu_per_tensor_parallel_rank() -> None:
    objects = _multi_gpu_objects()
    version = kubernetes_validate.latest_version()
    for kind in ("ConfigMap", "Deployment"):
        kubernetes_validate.validate(objects[kind], version, strict=True)
    server_args = objects["ConfigMap"]["data"]["SERVER_ARGS"].split()
    tp_size = int(server_args[server_args.index("--tp-size") + 1])
    assert tp_size > 1
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == tp_size
    assert _resource_quantity(resources["requests"]["memory"]) <= _resource_quantity(
        resources["limits"]["memory"]
    )
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    base_shm = {v["name"]: v for v in _k8s_objects()["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert _resource_quantity(shm["sizeLimit"]) >= _resource_quantity(
        base_shm[mounts["/dev/shm"]]["emptyDir"]["sizeLimit"]
    )
    assert {"profiles", "hf-cache"} <= set(volumes), "the base pod's other volumes stay"
    assert container["image"] == _image() and container["startupProbe"]["httpGet"]["path"] == "/health"


def test_k8s_monitoring_matches_the_prometheus_files() -> None:
    objects = _k8s_objects()
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert objects["PrometheusRule"]["spec"]["groups"] == alerts["groups"]
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    (endpoint,) = objects["PodMonitor"]["spec"]["podMetricsEndpoints"]
    camel = {"source_labels": "sourceLabels", "target_label": "targetLabel"}
    rules = job["metric_relabel_configs"]
    expected = [{camel.get(key, key): value for key, value in rule.items()} for rule in rules]
    assert endpoint["metricRelabelings"] == expected


@pytest.mark.parametrize(
    ("exposed", "stored"),
    [("sglang_bastion_tree_nodes_count", "sglang:bastion_tree_nodes_count"), ("up", "up")],
)
def test_metric_relabeling_restores_colon_names(exposed: str, stored: str) -> None:
    """Prometheus's relabel semantics (anchored regex, $1) applied to the deploy config's rule."""
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    (rule,) = job["metric_relabel_configs"]
    match = re.fullmatch(rule["regex"], exposed)
    result = rule["replacement"].replace("$1", match.group(1)) if match else exposed
    assert result == stored


# ---- Dashboard and alert rules -------------------------------------------------------------------


def test_every_dashboard_panel_has_a_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(panels) >= 8
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{panel['title']} {target['refId']}"
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_dashboard_covers_every_bastion_series_and_sglang_throughput() -> None:
    used = set().union(*(metric_names(query.expr) for query in dashboard_queries()))
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in BASTION_METRICS}
    used_families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
    assert families <= used_families, families - used_families
    assert "sglang:bastion_tree_nodes_bucket" in used, "the budget heatmap and quantiles read the buckets"
    assert {"sglang:generation_tokens_total", "sglang:spec_accept_length"} <= used


def test_dashboard_shows_data_parallel_replicas_side_by_side() -> None:
    """A `dp_rank` variable (All also matches servers without --dp-size) filters every panel, and a row of
    panels draws one line per replica."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    replica = variables["dp_rank"]
    assert replica["includeAll"] and replica["allValue"] == ".*"
    assert replica["query"]["query"].endswith(", dp_rank)")
    targets = [target for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for target in targets:
        selectors = re.findall(r"\{[^}]*\}", target["expr"].replace("{{", "").replace("}}", ""))
        assert selectors and all('dp_rank=~"$dp_rank"' in selector for selector in selectors), target["expr"]
    side_by_side = [
        target
        for target in targets
        if "sum by (dp_rank)" in target["expr"] and target["legendFormat"] == "replica {{dp_rank}}"
    ]
    shown = set().union(*(metric_names(_grafana_free(target["expr"])) for target in side_by_side))
    assert {
        "sglang:generation_tokens_total",
        "sglang:bastion_tree_nodes_count",
        "sglang:bastion_accept_length_count",
    } <= shown


def _grafana_free(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$", "")


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_queries_name_only_exported_metrics(source: str) -> None:
    queries = dashboard_queries() if source == "dashboard" else alert_queries()
    assert queries
    for query in queries:
        names = metric_names(query.expr)
        assert names, f"{query.where}: no metric in {query.expr!r}"
        assert names <= EXPORTED_METRICS, f"{query.where}: not exported: {sorted(names - EXPORTED_METRICS)}"


def test_a_misspelt_metric_is_caught() -> None:
    assert not metric_names('rate(sglang:bastion_tree_node_count{model_name=~".*"}[1m])') <= EXPORTED_METRICS


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le) (rate(a:b_bucket{x="y", z=~"w.*"}[5m]))', {"a:b_bucket"}),
        ("x / on(instance) group_left(model) y offset 5m", {"x", "y"}),
        ("histogram_quantile(0.9, sum(rate(h_bucket[1m])) without (pod)) > bool 1e3", {"h_bucket"}),
        ('abs(g - 1) > 0.5 or count_values("v", g) unless {__name__="k"}', {"g", "k"}),
        ("rate(c_total[$__rate_interval:30s])", {"c_total"}),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
