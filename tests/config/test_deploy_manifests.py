"""The Kubernetes manifests in docs/deploy/ agree with the server: each pod's command and
environment build a valid config, its container ports are the ports that config serves, the
probes hit the health port's routes, Prometheus scrapes the metrics port."""

import os
import re
import shlex

import pytest
import yaml

from tokenmill.config.server import build_server_config

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "deploy")
CONFIG_SOURCE = ""
_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "tokenmill", "config")
for _name in sorted(os.listdir(_CONFIG)):  # where environment variables are named
    if _name.endswith(".py"):
        with open(os.path.join(_CONFIG, _name)) as _f:
            CONFIG_SOURCE += _f.read()
# What a LeaderWorkerSet gives each pod of a group of 2 (the worker: index 1).
LWS = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "tokenmill-0.tokenmill",
       "LWS_WORKER_INDEX": "1"}


def pod_specs():
    for name in sorted(os.listdir(DEPLOY)):
        with open(os.path.join(DEPLOY, name)) as f:
            for doc in yaml.safe_load_all(f):
                spec = doc["spec"]
                if doc["kind"] == "Deployment":
                    yield name, "pod", spec["template"]
                elif doc["kind"] == "LeaderWorkerSet":
                    template = spec["leaderWorkerTemplate"]
                    yield name, "leader", template["leaderTemplate"]
                    yield name, "worker", template["workerTemplate"]


PODS = list(pod_specs())


def serve_argv(container: dict) -> list[str]:
    command = container["command"]
    if command[:2] == ["sh", "-c"]:
        text = re.sub(r"\$(\w+)", lambda m: LWS[m.group(1)], command[2])
        command = shlex.split(text.removeprefix("exec "))
    assert command[:2] == ["tokenmill", "serve"], command
    return command[2:]


def test_every_manifest_has_pods():
    assert {(name, role) for name, role, _ in PODS} == {
        ("single-node.yaml", "pod"), ("multi-node.yaml", "leader"),
        ("multi-node.yaml", "worker")}


@pytest.mark.parametrize("name,role,template", PODS, ids=[f"{n}:{r}" for n, r, _ in PODS])
def test_pod_config_ports_probes_and_scrape(name, role, template):
    (container,) = template["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    for variable in env:  # a typo would be silently ignored by the server
        assert f'"{variable}"' in CONFIG_SOURCE, f"{name}: {variable} is read nowhere"
    config = build_server_config(serve_argv(container), env)
    assert config.engine.model == env["MODEL_DIR"]
    assert config.engine.tensor_parallel_size == int(env["MP_NUM"])
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if role == "worker":
        assert config.engine.node_rank == 1 and not ports and "readinessProbe" not in container
        return
    assert config.engine.node_rank == 0
    assert {k: ports[k] for k in ("http", "health", "metrics", "grpc")} == {
        "http": config.port, "health": config.health_port, "metrics": config.metrics_port,
        "grpc": config.grpc_port}
    if config.engine.nnodes > 1:
        assert ports["rendezvous"] == config.engine.master_port
    for probe, path in (("livenessProbe", "/v2/health/live"),
                        ("readinessProbe", "/v2/health/ready"),
                        ("startupProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": "health"}
    scrape = template["metadata"]["annotations"]
    assert int(scrape["prometheus.io/port"]) == config.metrics_port
    assert scrape["prometheus.io/path"] == "/metrics"
