"""Deployment files, checked without a Docker engine or a cluster: hadolint on the Dockerfile, Kubernetes
schemas for the manifests, the Compose specification for compose.yaml, and the container's start command
against what the project ships."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import compose_spec
import pytest
import yaml

from triton_diffusion.serving.launcher import REPO_ROOT
from triton_diffusion.settings import config_parameters

DOCKER = REPO_ROOT / "docker"
K8S = DOCKER / "k8s"
BIN = Path(sys.executable).parent


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    result = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("manifest", ["deployment.yaml", "service.yaml", "hpa.yaml"])
def test_kubernetes_manifests_match_the_schemas(manifest):
    result = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "-k", "1.30.0", str(K8S / manifest)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "passed" in result.stdout, result.stdout + result.stderr


def docs(name):
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def test_monitoring_and_autoscaling_point_at_the_deployment():
    deployment = docs("deployment.yaml")[0]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    container, front_door = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The probes ask the supervisor, which knows when a model's process died (Triton 2.51 does not).
    assert container["args"][0] == "triton-diffusion-serve"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Liveness only once the first start loaded every model (/healthz is alive from the launcher's start).
    assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 8001, "metrics": 8002, "health": 8003, "openai": 9000}
    assert "--http-address=127.0.0.1" in container["args"]  # HTTP only through the front door
    # The OpenAI front faces clients: on in the pod, with keys from a Secret mounted where the args say.
    assert "--openai-port=9000" in container["args"]
    key_arg = next(a for a in container["args"] if a.startswith("--openai-api-key-file="))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert key_arg.split("=", 1)[1].startswith(mounts["openai-keys"] + "/")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["openai-keys"]["secret"]["secretName"] == "triton-diffusion-openai-keys"
    assert front_door["image"].startswith("nginx:")
    assert front_door["ports"] == [{"name": "http", "containerPort": 8080}]
    mounted = {m["subPath"] for m in front_door["volumeMounts"]}
    kustomize = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generated = kustomize["configMapGenerator"][0]
    assert {Path(f).name for f in generated["files"]} == mounted == {"nginx.conf", "json_guard.js"}
    assert all((K8S / f).is_file() for f in generated["files"])
    (podmonitor,) = docs("podmonitor.yaml")
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert podmonitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    for service in docs("service.yaml"):
        assert service["spec"]["selector"].items() <= labels.items()
    (hpa,) = docs("hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    assert adapter["rules"]["custom"][0]["name"]["as"] == hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    kustomize = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / resource).is_file() for resource in kustomize["resources"])


def test_a_stopping_pod_drains_into_a_volume_that_outlives_it():
    deployment, *claims = docs("deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]

    def seconds(option: str) -> float:
        return float(next(a for a in args if a.startswith(f"--{option}=")).split("=", 1)[1])

    # The drain, then Triton's exit timeout and the supervisor's margin, all before Kubernetes' SIGKILL.
    assert pod["terminationGracePeriodSeconds"] > seconds("drain-s") + seconds("exit-timeout-secs") + 10
    assert seconds("drain-s") > 0
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]  # not an emptyDir: lost with the pod
    assert claim in {c["metadata"]["name"] for c in claims if c["kind"] == "PersistentVolumeClaim"}
    assert "checkpoints" in {m["name"] for m in pod["containers"][0]["volumeMounts"]}
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["triton"]
    assert float(compose["stop_grace_period"].rstrip("s")) > 30 + 30 + 10  # the image's defaults


def test_compose_file_matches_the_compose_specification():
    compose = compose_spec.PyCompose.from_yaml((DOCKER / "compose.yaml").read_text())
    compose.validate()
    assert compose.service_names() == ["triton", "front-door", "prometheus"]
    raw = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    triton = raw["services"]["triton"]
    assert triton["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # Clients reach gRPC and the OpenAI front directly, HTTP only through the front door; metrics and health
    # stay local.
    assert triton["ports"] == ["8001:8001", "9000:9000", "127.0.0.1:8002:8002", "127.0.0.1:8003:8003"]
    # Each named volume's folder is made in the image and given to its user (uid 1000): Docker creates a
    # missing one root's, and a model whose checkpoint_dir cannot be written never loads.
    dockerfile = (DOCKER / "Dockerfile").read_text()
    made = re.search(r"mkdir -p ([^&]+)&& chown -R triton-server:triton-server ([^\n]+)", dockerfile)
    assert made, "the Dockerfile makes no folders for the volumes"
    for volume in triton["volumes"]:
        target = volume.split(":")[1]
        assert target in made.group(1).split() and target in made.group(2).split(), target
    front_door = raw["services"]["front-door"]
    assert front_door["ports"] == ["8000:8080"] and front_door["environment"]["TRITON_HTTP"] == "triton:8000"
    for volume in front_door["volumes"]:
        assert (DOCKER / volume.split(":")[0]).is_file()
    prometheus = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["triton:8002"]
    rules = yaml.safe_load((DOCKER / "prometheus" / "rules.yml").read_text())
    assert {r["record"].split(":")[1] for r in rules["groups"][0]["rules"]} >= {
        "triton_diffusion_fused_batch_size",
        "nv_inference_queue_ms_per_request",
        "nv_inference_request_success",
    }


def test_the_container_serves_the_shipped_model_repository():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR (\S+)", dockerfile, re.M).group(1)
    assert "COPY model_repository ./model_repository" in dockerfile
    repository = f"{workdir}/model_repository"
    assert f'"--model-repository={repository}"' in dockerfile
    assert 'CMD ["triton-diffusion-serve"' in dockerfile and '"--openai-port=9000"]' in dockerfile
    assert re.search(r"^EXPOSE .*\b9000\b", dockerfile, re.M)
    deployment = docs("deployment.yaml")[0]
    assert (
        f"--model-repository={repository}" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    weights_dir = re.search(r"triton-diffusion-build-tiny --weights-dir (\S+)", dockerfile).group(1)
    # Every shipped model's weights path, resolved inside the image, is where the image builds them.
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    for config_path in sorted((REPO_ROOT / "model_repository").glob("*/config.pbtxt")):
        config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
        assert config.backend == "python" and (config_path.parent / "1" / "model.py").is_file()
        params = config_parameters(json_format.MessageToDict(config, preserving_proto_field_name=True))
        in_image = Path(repository) / config_path.parent.name / params["model"]
        assert str(in_image.resolve()).startswith(weights_dir + "/"), (config_path, in_image)
