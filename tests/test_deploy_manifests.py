"""deploy/kubernetes: every manifest valid against Kubernetes' schemas, and consistent with the
server it deploys (no cluster is needed)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from flashserve.cli import build_parser
from flashserve.serve_args import to_configs

KUBERNETES = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# The oldest release the manifests use features of (the preStop `sleep` action is 1.30's).
KUBERNETES_VERSION = "1.30.0"


def documents() -> list[dict]:
    return [doc for path in sorted(KUBERNETES.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(kind: str, name: str) -> dict:
    (found,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def server_container() -> dict:
    return one("Deployment", "flashserve")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_against_the_kubernetes_schema(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_server_arguments_are_options_flashserve_accepts() -> None:
    args = to_configs(build_parser({}).parse_args(["serve", *server_container()["args"]]))
    assert args.model.model == "meta-llama/Llama-3.1-8B-Instruct"


def test_grace_period_outlasts_the_drain_and_the_pre_stop_pause() -> None:
    pod = one("Deployment", "flashserve")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in server_container()["env"]}
    pause = server_container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > float(env["FLASHSERVE_SHUTDOWN_TIMEOUT"]) + pause


def test_readiness_follows_health_which_turns_unready_while_draining() -> None:
    assert server_container()["readinessProbe"]["httpGet"]["path"] == "/health"


def test_services_budget_and_autoscaler_select_the_pods_they_are_for() -> None:
    for name in ("flashserve", "flashserve-router"):
        pod_labels = one("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert one("Service", name)["spec"]["selector"].items() <= pod_labels.items()
    pod_labels = one("Deployment", "flashserve")["spec"]["template"]["metadata"]["labels"]
    assert one("PodDisruptionBudget", "flashserve")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert one("HorizontalPodAutoscaler", "flashserve")["spec"]["scaleTargetRef"]["name"] == "flashserve"


def test_router_discovers_the_server_pods_by_their_label() -> None:
    router = one("Deployment", "flashserve-router")["spec"]["template"]["spec"]["containers"][0]
    selector = router["args"][router["args"].index("--selector") + 1]
    key, value = selector.split("=")
    assert one("Deployment", "flashserve")["spec"]["template"]["metadata"]["labels"][key] == value
