"""docs/kubernetes/pdserve.yaml holds together without a Kubernetes cluster: every object has the
fields its kind requires, each Deployment's selector selects its own pods, the Service reaches
the router's named ports, every command is one of ours with only flags its parser lists, the
nodes reach the router's Service and advertise an address others can dial, and the secret is
read from a Secret, never written in the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_containers import check_flags, flag_value

MANIFEST = Path(__file__).resolve().parents[2] / "docs" / "kubernetes" / "pdserve.yaml"
REQUIRED = {
    ("apps/v1", "Deployment"): ("spec.selector.matchLabels", "spec.template.spec.containers"),
    ("v1", "Service"): ("spec.selector", "spec.ports"),
}


def objects() -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def field(obj: dict, path: str):
    for key in path.split("."):
        obj = obj[key]
    return obj


def deployments() -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects() if o["kind"] == "Deployment"}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def command(deployment: dict) -> list[str]:
    spec = container(deployment)
    return [str(a) for a in spec["command"] + spec["args"]]


def test_every_object_has_the_fields_its_kind_requires():
    kinds = []
    for obj in objects():
        key = (obj["apiVersion"], obj["kind"])
        assert key in REQUIRED, key
        assert obj["metadata"]["name"].startswith("pdserve-")
        for path in REQUIRED[key]:
            assert field(obj, path), f"{obj['metadata']['name']}: {path} is empty"
        kinds.append(obj["kind"])
    assert sorted(kinds) == ["Deployment"] * 3 + ["Service"]


def test_each_deployment_selects_its_own_pods_and_the_service_the_router():
    for name, deployment in deployments().items():
        selector = deployment["spec"]["selector"]["matchLabels"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
    (service,) = [o for o in objects() if o["kind"] == "Service"]
    router = deployments()["pdserve-router"]
    assert service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"][
        "labels"
    ].items()
    named_ports = {p["name"]: p["containerPort"] for p in container(router)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(named_ports)
    assert container(router)["readinessProbe"]["httpGet"]["path"] == "/health"


def test_every_command_is_ours_with_existing_flags(capsys):
    for deployment in deployments().values():
        check_flags(command(deployment), capsys)


def test_nodes_reach_the_router_service_and_advertise_their_pod_address():
    router = command(deployments()["pdserve-router"])
    router_port = flag_value(router, "--listen")[0].rsplit(":", 1)[1]
    (service,) = [o for o in objects() if o["kind"] == "Service"]
    assert int(router_port) in {p["port"] for p in service["spec"]["ports"]}
    for role in ("prefill", "decode"):
        deployment = deployments()[f"pdserve-{role}"]
        node = command(deployment)
        assert node[:2] == ["pdserve", role]
        assert flag_value(node, "--router") == [f"tcp://{service['metadata']['name']}:{router_port}"]
        assert flag_value(node, "--kv-transport") == ["zmq"]
        (listen,) = flag_value(node, "--listen")
        (advertise,) = flag_value(node, "--advertise")
        assert advertise == listen.replace("0.0.0.0", "$(POD_IP)")
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(deployment)["env"]}
        assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
        assert flag_value(node, "--node-id") == ["$(POD_NAME)"]
    (kv_listen,) = flag_value(command(deployments()["pdserve-decode"]), "--kv-listen")
    assert "0.0.0.0" not in kv_listen, "the prefill node would dial 0.0.0.0"


def test_the_cluster_secret_comes_from_a_secret_never_the_file():
    assert "PDSERVE_CLUSTER_SECRET=" not in MANIFEST.read_text().replace(
        '--from-literal=PDSERVE_CLUSTER_SECRET="$(openssl', ""
    )
    for deployment in deployments().values():
        assert container(deployment)["envFrom"] == [{"secretRef": {"name": "pdserve-cluster"}}]
