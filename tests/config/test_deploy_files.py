"""The container files agree with the server: the Dockerfiles copy what exists, expose the
ports the config serves, probe the health port's readiness route, run as a non-root user with
the model at the seed's /models; the compose file runs the same, Prometheus scrapes the
metrics port, Grafana is provisioned with the dashboard, and every dashboard expression names
a metric a live server exports. The image is built where a Docker daemon is available."""

import json
import os
import re
import shlex
import subprocess

import httpx
import pytest
import yaml

from tokenmill.config.server import ServerConfig, build_server_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
DEFAULTS = ServerConfig(engine=None)
PORTS = {DEFAULTS.port, DEFAULTS.health_port, DEFAULTS.metrics_port, DEFAULTS.grpc_port}


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _instructions(name: str) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", _read(name))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _health_url(command: str) -> str:
    return re.search(r"http://127\.0\.0\.1:\d+/[\w/]+", command).group(0)


def _health_routes() -> set[str]:
    from tokenmill.entrypoints.http import server

    with open(server.__file__) as f:
        source = f.read()
    return set(re.findall(r'@app\.get\("(/[\w/]*)"\)', source))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile(name):
    steps = _instructions(name)
    kinds = [k for k, _ in steps]
    for kind, arg in steps:
        if kind == "COPY":
            for source in shlex.split(arg)[:-1]:
                assert os.path.exists(os.path.join(ROOT, source)), (name, source)
    exposed = {int(p) for k, a in steps if k == "EXPOSE" for p in a.split()}
    assert exposed == PORTS
    health = _health_url(next(a for k, a in steps if k == "HEALTHCHECK"))
    assert f":{DEFAULTS.health_port}/" in health
    assert health.split(str(DEFAULTS.health_port), 1)[1] in _health_routes()
    user = [a for k, a in steps if k == "USER"]
    assert user and user[-1] not in ("root", "0") and kinds.index("USER") > kinds.index("RUN")
    env = dict(kv.split("=", 1) for k, a in steps if k == "ENV" for kv in shlex.split(a))
    assert env["MODEL_DIR"] == "/models"
    config = build_server_config([], environ=env)
    assert config.engine.model == "/models" and config.log_dir == env["FD_LOG_DIR"]
    assert json.loads(next(a for k, a in steps if k == "ENTRYPOINT")) == ["tokenmill", "serve"]
    assert 'tokenmill = "tokenmill.entrypoints.cli:main"' in _read("pyproject.toml")


def test_compose_runs_the_image_scraped_and_charted():
    compose = yaml.safe_load(_read("docker-compose.yml"))["services"]
    app = compose["tokenmill"]
    assert {int(p.split(":")[1]) for p in app["ports"]} == PORTS
    assert any(v.rsplit(":", 2)[1] == "/models" for v in app["volumes"])
    config = build_server_config(app["command"], environ={"MODEL_DIR": "/models"})
    assert config.engine.log_format == "json"
    dockerfile_check = next(a for k, a in _instructions("Dockerfile") if k == "HEALTHCHECK")
    assert _health_url(" ".join(app["healthcheck"]["test"])) == _health_url(dockerfile_check)
    mounts = [v.split(":")[0] for s in compose.values() for v in s.get("volumes", [])
              if v.startswith("./docs")]
    assert mounts and all(os.path.exists(os.path.join(ROOT, m)) for m in mounts)
    scrape = yaml.safe_load(_read("docs/grafana/prometheus.yml"))
    [target] = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == f"tokenmill:{DEFAULTS.metrics_port}"
    source = yaml.safe_load(_read("docs/grafana/provisioning/datasources/prometheus.yml"))
    uid = source["datasources"][0]["uid"]
    dashboard = json.loads(_read("docs/grafana/tokenmill.json"))
    assert all(p["datasource"]["uid"] == uid for p in dashboard["panels"])


def _expressions() -> list[str]:
    dashboard = json.loads(_read("docs/grafana/tokenmill.json"))
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]] + [
        v["query"] for v in dashboard["templating"]["list"]]


def test_every_panel_names_an_exported_metric(served_llama):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(served_llama.api + "/v1/completions", timeout=120,
               json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    exported = {f.name for f in text_string_to_metric_families(
        httpx.get(served_llama.metrics + "/metrics").text)}
    names = {re.sub(r"_(total|bucket|sum|count)$", "", n)
             for e in _expressions() for n in re.findall(r"tokenmill:[a-z0-9_]+", e)}
    assert len(names) >= 15 and names <= exported, names - exported


def _docker_ready() -> bool:
    try:
        return subprocess.run(["docker", "image", "inspect", "python:3.11-slim"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _docker_ready(), reason="no Docker daemon with python:3.11-slim")
def test_the_cpu_image_builds():
    done = subprocess.run(["docker", "build", "-q", "-t", "tokenmill:test", ROOT],
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
