"""The deployment files in deploy/ hold together: manifests parse, Kustomize finds what it lists,
probes and volumes match what the server does, and the dashboard asks only for metrics it exposes."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "kustomize" / "base"
GPU_OVERLAY = DEPLOY / "kustomize" / "overlays" / "gpu"
CPU_OVERLAY = DEPLOY / "kustomize" / "overlays" / "cpu"
ADAPTER_RULES = DEPLOY / "prometheus-adapter" / "rules.yaml"
BASE_KINDS = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service"]
# What server/src/metrics.rs registers (prefix cleave_), with the series Prometheus stores for each.
COUNTERS = ["requests", "slo_misses", "received_bytes", "sent_bytes"]
HISTOGRAMS = ["request_seconds", "queue_seconds", "compute_seconds", "batch_samples"]
GAUGES = ["queue_depth", "open_streams", "training_sessions", "device_memory_used_bytes"]
SERIES = (
    {f"cleave_{m}_total" for m in COUNTERS}
    | {f"cleave_{m}_{s}" for m in HISTOGRAMS for s in ("bucket", "sum", "count")}
    | {f"cleave_{m}" for m in GAUGES}
)


def documents(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def base_resources() -> list:
    kustomization = documents(BASE / "kustomization.yaml")[0]
    return [d for name in kustomization["resources"] for d in documents(BASE / name)]


def base_one(kind: str) -> dict:
    (found,) = [d for d in base_resources() if d["kind"] == kind]
    return found


def server_container() -> dict:
    (container,) = base_one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration).groups()
    return float(value) * {"ms": 0.001, "s": 1, "m": 60}[unit]


def test_every_yaml_file_parses_and_names_itself():
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 10, files
    for path in files:
        for doc in documents(path):
            if path.name == "kustomization.yaml":
                assert doc["kind"] == "Kustomization" and doc.get("resources"), path
            elif path == ADAPTER_RULES:
                for rule in doc["rules"]:
                    assert {"seriesQuery", "resources", "name", "metricsQuery"} <= rule.keys(), path
            else:
                assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), f"{path}: {doc}"


def test_kustomizations_list_existing_files_and_the_base_holds_every_kind():
    for path in DEPLOY.rglob("kustomization.yaml"):
        kustomization = documents(path)[0]
        listed = kustomization.get("resources", []) + [p["path"] for p in kustomization.get("patches", []) if "path" in p]
        for entry in listed:
            assert (path.parent / entry).exists(), f"{path} lists {entry}, which is missing"
    assert sorted(d["kind"] for d in base_resources()) == BASE_KINDS


def test_probes_security_service_autoscaler_and_gpu():
    container = server_container()
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    health_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    server_yaml = yaml.safe_load(base_one("ConfigMap")["data"]["server.yaml"])
    # The probes speak plaintext: they read the health listener, never the TLS port.
    assert server_yaml["health_listen"].endswith(f":{health_port}") and health_port != grpc_port
    for probe, service in [("readinessProbe", ""), ("livenessProbe", "cleave.liveness"), ("startupProbe", "cleave.liveness")]:
        assert container[probe]["grpc"] == {"port": health_port, "service": service}, probe
    pod = base_one("Deployment")["spec"]["template"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]

    service = base_one("Service")
    assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses", False)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert any(p["port"] == grpc_port for p in service["spec"]["ports"])

    hpa = base_one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cleave-server"}
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"] == ["cleave_queue_depth"]
    assert [r["name"]["as"] for r in documents(ADAPTER_RULES)[0]["rules"]] == ["cleave_queue_depth"]

    patches = [d for p in documents(GPU_OVERLAY / "kustomization.yaml")[0]["patches"] for d in documents(GPU_OVERLAY / p["path"])]
    containers = [c for d in patches if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    assert [c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for c in containers] == [1]


def test_server_config_names_only_mounted_files_and_drains_within_the_grace_period():
    container = server_container()
    config_mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in config_mount, "podman's kube play mounts a ConfigMap's subPath as a directory"
    config_file = container["args"][1]
    assert container["args"][0] == "--config" and Path(config_file).parent == Path(config_mount["mountPath"])
    config = yaml.safe_load(base_one("ConfigMap")["data"][Path(config_file).name])

    def paths(node):
        if isinstance(node, dict):
            return [p for v in node.values() for p in paths(v)]
        if isinstance(node, list):
            return [p for v in node for p in paths(v)]
        return [node] if isinstance(node, str) and node.startswith("/") else []

    named = paths(config)
    assert len(named) >= 6, named  # bundle, cert, key, token, payload key, checkpoints
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    secret_keys = base_one("Secret").get("stringData", {}).keys() | base_one("Secret").get("data", {}).keys()
    for path in named:
        under = [m for m in mounts.values() if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert under, f"server.yaml names {path}, which no volume mount holds"
        if under[0]["name"] == "secrets":
            assert Path(path).name in secret_keys, f"{path} is not a key of the Secret"
    assert mounts["secrets"]["readOnly"] and mounts["bundles"]["readOnly"]

    limits = config["limits"]
    grace = base_one("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > seconds(limits["drain_notice"]) + seconds(limits["drain_timeout"])


def test_dashboard_asks_only_for_exposed_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "cleave-dashboard.json").read_text())
    assert dashboard["schemaVersion"] >= 36
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = set(re.findall(r"\bcleave_[a-z_]+", " ".join(exprs)))
    assert used <= SERIES, f"not exposed: {sorted(used - SERIES)}"
    shown = {"requests_total", "request_seconds_bucket", "queue_depth", "slo_misses_total", "batch_samples_sum", "open_streams"}
    missing = {f"cleave_{m}" for m in shown | {"device_memory_used_bytes"}} - used
    assert not missing, f"no panel shows {sorted(missing)}"


def test_gpu_overlay_renders_with_kubectl():
    docs = render(GPU_OVERLAY)
    assert sorted(d["kind"] for d in docs) == BASE_KINDS
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def render(overlay: Path) -> list:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    rendered = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in yaml.safe_load_all(rendered.stdout) if d is not None]


def test_cpu_overlay_renders_three_cpu_servers_without_a_gpu():
    docs = render(CPU_OVERLAY)
    assert sorted(d["kind"] for d in docs) == BASE_KINDS
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 3
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "cleave-server:cpu"
    assert "nvidia.com/gpu" not in json.dumps(deployment)
    assert "nodeSelector" not in deployment["spec"]["template"]["spec"]
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["minReplicas"] == 3
    # The overlay's server.yaml is the base's with `device: cpu`, every other key the same.
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    served = yaml.safe_load(config_map["data"]["server.yaml"])
    base = yaml.safe_load(base_one("ConfigMap")["data"]["server.yaml"])
    assert served["device"] == "cpu" and base["device"] == "cuda"
    assert {**served, "device": "cuda"} == base


def test_dockerfile_builds_three_images_the_cuda_server_by_default():
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+) AS (\S+)$", text, re.MULTILINE)
    names = [name for _, name in stages]
    assert {"edge", "server-cpu", "server-cuda"} <= set(names)
    assert names[-1] == "server-cuda", "a plain `docker build` must make the CUDA server"
    assert dict((name, base) for base, name in stages)["server-cpu"] == "runtime"
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    # The CPU binaries link a libtorch directory without libtorch_cuda.
    assert "! -name 'libtorch_cuda*'" in text


def test_the_runc_wrapper_drops_rlimits_and_passes_every_argument(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = {"ociVersion": "1.0.2", "process": {"args": ["true"], "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]}}
    (bundle / "config.json").write_text(json.dumps(config))
    fake = tmp_path / "runc"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$(dirname "$0")/args"\n')
    fake.chmod(0o755)
    args = ["--root", "/run/runc", "create", "--bundle", str(bundle), "--pid-file", "/tmp/pid", "abc"]
    env = {"PATH": "/usr/bin:/bin", "CLEAVE_REAL_RUNC": str(fake)}
    subprocess.run([str(DEPLOY / "oci" / "runc"), *args], env=env, check=True, timeout=30)
    assert (tmp_path / "args").read_text().splitlines() == args
    after = json.loads((bundle / "config.json").read_text())
    assert "rlimits" not in after["process"] and after["process"]["args"] == ["true"]
    # `exec --process FILE`: the process file loses its rlimits too.
    process = tmp_path / "process.json"
    process.write_text(json.dumps(config["process"]))
    subprocess.run([str(DEPLOY / "oci" / "runc"), "exec", "--process", str(process), "abc"], env=env, check=True, timeout=30)
    assert json.loads(process.read_text()) == {"args": ["true"]}
    # Other commands leave the bundle alone.
    (bundle / "config.json").write_text(json.dumps(config))
    subprocess.run([str(DEPLOY / "oci" / "runc"), "state", "--bundle", str(bundle), "abc"], env=env, check=True, timeout=30)
    assert json.loads((bundle / "config.json").read_text()) == config


def test_deploy_scripts_parse():
    for script in ["image-bases", "build-image", "engine.sh", "oci/runc"]:
        checked = subprocess.run(["bash", "-n", str(DEPLOY / script)], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, f"{script}: {checked.stderr}"
    compile((DEPLOY / "check").read_text(), "deploy/check", "exec")
