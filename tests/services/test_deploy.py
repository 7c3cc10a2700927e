"""deploy/: compose and k8s files are valid and agree with the `dsaserve` command-line contract.

No Docker engine or cluster here: compose is validated by docker-compose 1.29's `config` (works
without an engine), k8s by parsing and, where kubectl is installed, by rendering the kustomizations.
The flag checks read every `dsaserve ...` command line and every DSASERVE_* variable and hold them
to the flags each subcommand's settings define, and the real `--help` is checked to list them,
with the router run as its image runs it: without torch.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsaserve.services import settings
from dsaserve.services.cli import COMMANDS, command_module
from tests import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"

# The flags of each subcommand, derived from its settings dataclass (services/settings.py):
# deploy files must use current names (old aliases still parse, but are deprecated).
_FLAGS = {cmd: settings.flags(command_module(cmd).Settings) for cmd in COMMANDS}
FLAGS = {cmd: {f.option[2:] for f in flags if not f.positional} for cmd, flags in _FLAGS.items()}
POSITIONAL = {cmd: sum(f.positional for f in flags) for cmd, flags in _FLAGS.items()}
CHOICES = {f.option[2:]: set(f.choices) for fs in _FLAGS.values() for f in fs if f.choices}
SWITCHES = {f.option[2:] for fs in _FLAGS.values() for f in fs if not f.takes_value}
ENV = {
    "DSASERVE_CLUSTER_TOKEN": "test-token",
    "REDIS_PASSWORD": "redis-secret",
    "DSASERVE_API_KEY": "k1,k2",
    "DSASERVE_MODEL_DIR": "/srv/ckpt",
}


# --- helpers --------------------------------------------------------------------------------------


def dsaserve_commands(argv: list[str]) -> list[list[str]]:
    """The `dsaserve ...` invocations in a container command, looking inside `sh -c` scripts."""
    if len(argv) >= 3 and argv[0] in ("sh", "bash") and argv[1] == "-c":
        lexer = shlex.shlex(argv[2], posix=True, punctuation_chars=True)
        segment: list[str] = []
        segments = [segment]
        for token in lexer:
            if token in ("||", "&&", ";", "|"):
                segment = []
                segments.append(segment)
            else:
                segment.append(token)
        return [
            s[1:] if s[:1] == ["exec"] else s
            for s in segments
            if s[:1] == ["dsaserve"] or s[:2] == ["exec", "dsaserve"]
        ]
    return [argv] if argv[:1] == ["dsaserve"] else []


def command_problems(cmd: list[str]) -> list[str]:
    sub, rest = cmd[1] if len(cmd) > 1 else "", cmd[2:]
    if sub not in FLAGS:
        return [f"unknown subcommand in {cmd}"]
    problems, positional, i = [], [], 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--"):
            positional.append(token)
            i += 1
            continue
        name, _, value = token[2:].partition("=")
        if not value and name not in SWITCHES:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                problems.append(f"{sub}: --{name} has no value")
            else:
                value = rest[i + 1]
            i += 1
        i += 1
        if name not in FLAGS[sub]:
            problems.append(f"{sub}: unknown flag --{name}")
        elif name in CHOICES and value not in CHOICES[name]:
            problems.append(f"{sub}: --{name} {value} not in {sorted(CHOICES[name])}")
    if len(positional) != POSITIONAL[sub]:
        problems.append(f"{sub}: positional arguments {positional}")
    return problems


def env_problems(env: dict[str, Any], roles: list[str]) -> list[str]:
    """Every DSASERVE_* variable must be a flag of each role that reads it (flags.py's mapping)."""
    problems = []
    for name, value in env.items():
        if not name.startswith("DSASERVE_"):
            continue
        flag = name[len("DSASERVE_") :].lower().replace("_", "-")
        for role in roles:
            if flag not in FLAGS[role]:
                problems.append(f"{role}: {name} is not a flag of `dsaserve {role}`")
        if (
            flag in CHOICES
            and isinstance(value, str)
            and "$" not in value
            and value not in CHOICES[flag]
        ):
            problems.append(f"{name}={value} not in {sorted(CHOICES[flag])}")
    return problems


def flag_value(cmd: list[str], flag: str) -> str | None:
    for i, token in enumerate(cmd):
        if token == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def load_compose(*files: Path) -> dict[str, Any]:
    """PyYAML resolves anchors and `<<` merges; later files override (compose's rule for maps)."""
    services: dict[str, dict[str, Any]] = {}
    for file in files:
        for name, svc in yaml.safe_load(file.read_text())["services"].items():
            merged = services.setdefault(name, {})
            for key, value in svc.items():
                if isinstance(value, dict) and isinstance(merged.get(key), dict):
                    merged[key] = {**merged[key], **value}
                else:
                    merged[key] = value
    return services


def compose_env(svc: dict[str, Any]) -> dict[str, Any]:
    env = svc.get("environment") or {}
    return env if isinstance(env, dict) else dict(item.split("=", 1) for item in env)


def k8s_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc.get("kind") == "LeaderWorkerSet":
        group = doc["spec"]["leaderWorkerTemplate"]
        templates = (group.get("leaderTemplate"), group.get("workerTemplate"))
        return [t["spec"] for t in templates if t]
    spec = ((doc.get("spec") or {}).get("template") or {}).get("spec")
    return [spec] if doc.get("kind") == "Deployment" and spec else []


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return (spec.get("initContainers") or []) + (spec.get("containers") or [])


def container_role(container: dict[str, Any]) -> list[str]:
    argv = (container.get("command") or []) + (container.get("args") or [])
    if argv[:2] and argv[0] == "dsaserve" and argv[1] in ("router", "prefill", "decode"):
        return [argv[1]]
    return {"router": ["router"], "worker": ["prefill", "decode"]}.get(
        container.get("name", ""), []
    )


def literal_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


# --- compose --------------------------------------------------------------------------------------


def _docker_compose(
    *args: str, env: dict[str, str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip(
            "docker-compose is not installed "
            "(apt-get install -y --no-install-recommends docker-compose)"
        )
    # An empty env file, so a developer's deploy/.env cannot change the outcome.
    empty = tmp_path / "empty.env"
    empty.write_text("")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DSASERVE_")}
    return subprocess.run(
        [exe, "--env-file", str(empty), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_config_validates(tmp_path: Path) -> None:
    base = _docker_compose("-f", str(COMPOSE), "config", "-q", env=ENV, tmp_path=tmp_path)
    assert base.returncode == 0, base.stderr
    gpu = _docker_compose(
        "-f", str(COMPOSE), "-f", str(COMPOSE_GPU), "config", "-q", env=ENV, tmp_path=tmp_path
    )
    assert gpu.returncode == 0, gpu.stderr
    profile = _docker_compose(
        "-f",
        str(COMPOSE),
        "--profile",
        "observability",
        "config",
        "--services",
        env=ENV,
        tmp_path=tmp_path,
    )
    assert profile.returncode == 0, profile.stderr
    assert {"redis", "model-init", "router", "prefill", "decode", "prometheus", "grafana"} <= set(
        profile.stdout.split()
    )


def test_compose_refuses_to_run_without_secrets(tmp_path: Path) -> None:
    result = _docker_compose(
        "-f", str(COMPOSE), "config", "-q", env={"DSASERVE_API_KEY": "k"}, tmp_path=tmp_path
    )
    assert result.returncode != 0
    assert "DSASERVE_CLUSTER_TOKEN" in result.stderr
    token_only = {"DSASERVE_API_KEY": "k", "DSASERVE_CLUSTER_TOKEN": "t"}
    result = _docker_compose("-f", str(COMPOSE), "config", "-q", env=token_only, tmp_path=tmp_path)
    assert result.returncode != 0 and "REDIS_PASSWORD" in result.stderr


def test_redis_requires_the_password_every_client_uses() -> None:
    services = load_compose(COMPOSE)
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1] == "${REDIS_PASSWORD}"
    for name in ("router", "prefill", "decode"):
        url = compose_env(services[name])["DSASERVE_REDIS_URL"]
        assert url.startswith("redis://:${REDIS_PASSWORD"), (name, url)
    (redis_k8s,) = [
        c for _, d in k8s_docs() for spec in pod_specs(d) for c in containers(spec)
        if c["name"] == "redis"
    ]  # fmt: skip
    assert "--requirepass" in redis_k8s["args"]
    for _, doc in k8s_docs():
        for spec in pod_specs(doc):
            for c in containers(spec):
                env = {e["name"]: e for e in c.get("env") or []}
                if c["name"] in ("router", "worker") and "image" in c:  # not a patch
                    assert "$(REDIS_PASSWORD)" in env["DSASERVE_REDIS_URL"]["value"], c["name"]
                    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == (
                        "redis-password"
                    )


def test_compose_commands_use_only_contract_flags() -> None:
    found: dict[str, int] = {}
    problems: list[str] = []
    for files in ((COMPOSE,), (COMPOSE, COMPOSE_GPU)):
        for svc in load_compose(*files).values():
            command = svc.get("command") or []
            command = (
                shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
            )
            for cmd in dsaserve_commands(command):
                found[cmd[1]] = found.get(cmd[1], 0) + 1
                problems += command_problems(cmd)
                problems += env_problems(
                    compose_env(svc), [cmd[1]] if cmd[1] in ("router", "prefill", "decode") else []
                )
    assert not problems, problems
    assert set(found) == {"router", "prefill", "decode", "make-tiny-model"}, found


def _router_commands() -> Iterator[tuple[str, list[str]]]:
    """Every `dsaserve router` command line of the deploy files, with where it is."""
    for files in ((COMPOSE,), (COMPOSE, COMPOSE_GPU)):
        for name, svc in load_compose(*files).items():
            command = svc.get("command") or []
            command = (
                shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
            )
            for cmd in dsaserve_commands(command):
                yield f"{files[-1].name}:{name}", cmd
    for path, doc in k8s_docs():
        for spec in pod_specs(doc):
            for c in containers(spec):
                argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
                for cmd in dsaserve_commands(argv):
                    yield f"{path.name}:{c['name']}", cmd
    for line in (DEPLOY / "Dockerfile.router").read_text().splitlines():
        if line.startswith("CMD "):
            yield "Dockerfile.router", json.loads(line.removeprefix("CMD "))


def test_containers_bind_the_router_to_every_interface() -> None:
    """`dsaserve router` binds 127.0.0.1 unless told otherwise, which in a container no one
    outside could reach: every deploy file says 0.0.0.0 itself (and requires API keys)."""
    routers = [(where, cmd) for where, cmd in _router_commands() if cmd[1] == "router"]
    assert {where.split(":")[0] for where, _ in routers} >= {
        "docker-compose.yml",
        "router.yaml",
        "Dockerfile.router",
    }
    assert [where for where, cmd in routers if flag_value(cmd, "--host") != "0.0.0.0"] == []


def test_compose_ports_healthchecks_and_mounts_agree() -> None:
    services = load_compose(COMPOSE)
    scrape = {
        job["job_name"]: job
        for job in yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())[
            "scrape_configs"
        ]
    }
    for name, port_flag in (
        ("router", "--port"),
        ("prefill", "--metrics-port"),
        ("decode", "--metrics-port"),
    ):
        svc = services[name]
        port = flag_value([str(c) for c in svc["command"]], port_flag)
        assert port, f"{name} sets no {port_flag}"
        assert f"127.0.0.1:{port}/" in " ".join(svc["healthcheck"]["test"]), (
            f"{name} healthcheck port"
        )
        sd = scrape[name]["dns_sd_configs"][0]
        assert sd["names"] == [name] and str(sd["port"]) == port, f"prometheus job {name}"
        deps = svc["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["model-init"]["condition"] == "service_completed_successfully"
    assert services["router"]["ports"][0].endswith(
        ":" + flag_value([str(c) for c in services["router"]["command"]], "--port")
    )
    for name, svc in services.items():
        for volume in svc.get("volumes") or []:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    for name in ("prefill", "decode"):
        assert compose_env(services[name])["UCX_TLS"] == "tcp"  # cma/shm cannot cross containers


# --- Dockerfiles ----------------------------------------------------------------------------------


def _copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for line in dockerfile.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            sources += [p for p in parts[1:-1] if not p.startswith("--")]
    return sources


@pytest.mark.parametrize("image", ["router", "worker"])
def test_dockerfile_copies_exist_and_pass_the_dockerignore(image: str) -> None:
    dockerfile = DEPLOY / f"Dockerfile.{image}"
    allowed = {
        line[1:].rstrip("/")
        for line in (DEPLOY / f"Dockerfile.{image}.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    sources = _copy_sources(dockerfile)
    assert sources
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
        assert source.rstrip("/") in allowed, f"{source} is excluded by the .dockerignore"


def test_router_image_has_no_torch() -> None:
    requirements = (DEPLOY / "requirements-serve.txt").read_text()
    pins = dict(
        line.split("==") for line in requirements.splitlines() if line and not line.startswith("#")
    )
    assert set(pins) == {
        "fastapi",
        "uvicorn",
        "uvloop",  # the router's event loop and HTTP parser (services/router/http_server.py)
        "httptools",
        "grpcio",
        "protobuf",
        "redis",
        "prometheus-client",
        "tokenizers",
        "jinja2",
        "pydantic",
        "httpx",
        "llguidance",  # structured outputs: the router compiles grammars (no torch needed)
    }
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in pins.values()), pins
    router = (DEPLOY / "Dockerfile.router").read_text()
    assert "pip install --no-deps /src" in router  # pyproject.toml's deps would pull torch


def test_worker_entrypoint_fills_address_and_id(tmp_path: Path) -> None:
    script = DEPLOY / "worker-entrypoint.sh"
    assert os.access(script, os.X_OK), "the image relies on the committed exec bit"
    fake = tmp_path / "dsaserve"  # stands in for the CLI only to print what it was started with
    fake.write_text('#!/bin/sh\necho "$DSASERVE_ADVERTISE_HOST|$DSASERVE_WORKER_ID|$*"\n')
    fake.chmod(0o755)
    path = f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSASERVE_")}
    out = subprocess.run(
        [str(script), "dsaserve", "decode", "--max-num-seqs", "4"],
        env={**env, "PATH": path},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()
    host, worker_id, args = out.split("|")
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", host), out
    assert worker_id.startswith("decode-") and len(worker_id) > len("decode-")
    assert args == "decode --max-num-seqs 4"
    preset = {
        **env,
        "PATH": path,
        "DSASERVE_ADVERTISE_HOST": "10.1.2.3",
        "DSASERVE_WORKER_ID": "w7",
    }
    out = subprocess.run(
        [str(script), "dsaserve", "prefill"],
        env=preset,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.startswith("10.1.2.3|w7|")


# --- Kubernetes -----------------------------------------------------------------------------------


def test_k8s_manifests_parse_and_kustomizations_reference_existing_files() -> None:
    kustomizations = sorted(K8S.rglob("kustomization.yaml"))
    assert {p.parent.relative_to(K8S).as_posix() for p in kustomizations} >= {
        "base",
        "base/worker",
        "base/prefill",
        "base/decode",
        "overlays/gpu",
        "overlays/tls",
    }
    for path, doc in k8s_docs():
        assert doc.get("kind") and doc.get("apiVersion"), f"{path}: not a k8s object"
    for path in kustomizations:
        k = yaml.safe_load(path.read_text())
        refs = list(k.get("resources") or []) + [
            p["path"] for p in k.get("patches") or [] if "path" in p
        ]
        for ref in refs:
            assert (path.parent / ref).exists(), f"{path}: {ref} does not exist"
        for generator in k.get("secretGenerator") or []:
            for env_file in generator.get("envs") or []:
                # The real file is git-ignored; the example documents its keys.
                assert (path.parent / f"{env_file}.example").exists(), (
                    f"{path}: no {env_file}.example"
                )


def test_k8s_commands_and_env_use_only_contract_flags() -> None:
    found, problems = set(), []
    config_keys = {}
    for path, doc in k8s_docs():
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "dsaserve-config":
            config_keys.update(doc["data"])
        for spec in pod_specs(doc):
            for c in containers(spec):
                argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
                for cmd in dsaserve_commands(argv):
                    found.add(cmd[1])
                    problems += [f"{path.name}: {p}" for p in command_problems(cmd)]
                problems += [
                    f"{path.name}: {p}" for p in env_problems(literal_env(c), container_role(c))
                ]
    # envFrom: the shared ConfigMap reaches the router and both worker roles.
    problems += env_problems(config_keys, ["router", "prefill", "decode"])
    assert not problems, problems
    assert found == {"router", "prefill", "decode", "make-tiny-model"}, found
    assert config_keys, "no dsaserve-config ConfigMap"


def test_k8s_worker_ports_and_probes_agree() -> None:
    doc = yaml.safe_load((K8S / "base/worker/deployment.yaml").read_text())
    (worker,) = doc["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    env = literal_env(worker)
    assert int(env["DSASERVE_PORT"]) == ports["grpc"]
    assert int(env["DSASERVE_METRICS_PORT"]) == ports["metrics"]
    assert env["UCX_TLS"] == "tcp"
    probes = {
        kind: worker[kind]["httpGet"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert {p["port"] for p in probes.values()} == {"metrics"}
    assert (
        probes["livenessProbe"]["path"] == "/live" and probes["readinessProbe"]["path"] == "/ready"
    )
    # Model load must fit in the startup budget, not trip liveness.
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    router = yaml.safe_load_all((K8S / "base/router.yaml").read_text())
    (router_c,) = next(router)["spec"]["template"]["spec"]["containers"]
    assert int(flag_value(router_c["args"], "--port")) == router_c["ports"][0]["containerPort"]
    assert router_c["readinessProbe"]["httpGet"]["path"] == "/health"
    # No workers must not mean restarts: liveness asks only whether the process answers.
    assert router_c["livenessProbe"]["httpGet"]["path"] == "/live"


def _render(tmp_path: Path, overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its built-in kustomize renders the overlays)")
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    (tree / "base/secrets.env").write_text("cluster-token=t\napi-keys=k1\n")
    out = subprocess.run(
        [kubectl, "kustomize", str(tree / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_k8s_tls_overlay_puts_every_grpc_link_in_mutual_tls(tmp_path: Path) -> None:
    docs = _render(tmp_path, "overlays/tls")
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for name in ("router", "prefill", "decode"):
        spec = deployments[name]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["DSASERVE_GRPC_TLS_SERVER_NAME"] == "dsaserve-worker"
        assert {"DSASERVE_GRPC_TLS_CERT", "DSASERVE_GRPC_TLS_KEY", "DSASERVE_GRPC_TLS_CA"} <= set(
            env
        )
        assert ("DSASERVE_GRPC_TLS_REQUIRE_CLIENT_CERT" in env) == (name != "router")
        mounted = {m["name"] for m in c["volumeMounts"]}
        secrets = {v["name"]: v.get("secret", {}).get("secretName") for v in spec["volumes"]}
        assert "grpc-tls" in mounted and secrets["grpc-tls"] == "dsaserve-grpc-tls"


@pytest.mark.parametrize("overlay", ["base", "overlays/gpu", "overlays/tls"])
def test_k8s_renders_the_disagg_topology(tmp_path: Path, overlay: str) -> None:
    docs = _render(tmp_path, overlay)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"redis", "router", "prefill", "decode"}
    assert all(d["metadata"]["namespace"] == "dsaserve" for d in docs if d["kind"] != "Namespace")
    for name in ("prefill", "decode"):
        (c,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert c["args"][:2] == ["dsaserve", name]
        assert not command_problems(c["args"])
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus is not None) == (overlay == "overlays/gpu")
    # Every Service selects the pods of exactly one Deployment.
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"].items()
        matches = [
            n
            for n, d in deployments.items()
            if selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matches == [svc["metadata"]["name"]], (svc["metadata"]["name"], matches)
    secret = next(d for d in docs if d["kind"] == "Secret")
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for d in deployments.values()
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {secret["metadata"]["name"]}  # the generator's hashed name reached every user


# The LeaderWorkerSet v1 API (sigs.k8s.io/lws, api/leaderworkerset/v1): its spec's fields, their
# types and enums; a field outside it would be dropped or refused by the CRD's schema.
LWS_SPEC = {
    "replicas": int,
    "startupPolicy": ("LeaderCreated", "LeaderReady"),
    "rolloutStrategy": dict,
    "networkConfig": dict,
    "leaderWorkerTemplate": {
        "size": int,
        "restartPolicy": ("RecreateGroupOnPodRestart", "None", "Default"),
        "leaderTemplate": dict,
        "workerTemplate": dict,
        "subGroupPolicy": dict,
    },
}


def lws_schema_problems(spec: dict[str, Any], schema: dict[str, Any], at: str = "spec") -> list:
    problems = []
    for key, value in spec.items():
        want = schema.get(key)
        if want is None:
            problems.append(f"{at}.{key}: not a LeaderWorkerSet v1 field")
        elif isinstance(want, dict):
            problems += lws_schema_problems(value, want, f"{at}.{key}")
        elif isinstance(want, tuple) and value not in want:
            problems.append(f"{at}.{key}: {value!r} not in {want}")
        elif isinstance(want, type) and not isinstance(value, want):
            problems.append(f"{at}.{key}: not a {want.__name__}")
    return problems


def test_k8s_lws_overlay_runs_decode_as_one_group_over_two_nodes(tmp_path: Path) -> None:
    docs = _render(tmp_path, "overlays/lws")
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert deployments == {"redis", "router", "prefill"}
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["namespace"] == "dsaserve"
    assert not lws_schema_problems(lws["spec"], LWS_SPEC)
    group = lws["spec"]["leaderWorkerTemplate"]
    pod = group["workerTemplate"]
    (c,) = pod["spec"]["containers"]
    assert c["args"][:2] == ["dsaserve", "decode"] and not command_problems(c["args"])
    # one node per pod, meeting at the leader; whole data-parallel ranks on each
    nnodes = int(flag_value(c["args"], "--nnodes"))
    assert nnodes == group["size"] == 2
    assert flag_value(c["args"], "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert flag_value(c["args"], "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    assert int(flag_value(c["args"], "--data-parallel-size")) % nnodes == 0
    assert "--enable-expert-parallel" in c["args"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["rendezvous"] == int(flag_value(c["args"], "--master-port"))
    assert int(literal_env(c)["DSASERVE_PORT"]) == ports["grpc"]
    # the decode Service (scraping, probes) still selects the decode pods
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "decode")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    secret = next(d for d in docs if d["kind"] == "Secret")["metadata"]["name"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for d in docs
        for spec in pod_specs(d)
        for c in spec["containers"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {secret}


# --- Grafana --------------------------------------------------------------------------------------


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/dsaserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"dsaserve_\w+", e)}


def test_dashboard_is_provisionable() -> None:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/dsaserve.json").read_text())
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/dsaserve.yml").read_text()
    )["providers"][0]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    # compose mounts the dashboards where the provider looks; the datasource points at Prometheus.
    grafana = load_compose(COMPOSE)["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    assert datasource["url"] == "http://prometheus:9090"
    assert {
        "dsaserve_kv_pages_free",
        "dsaserve_kv_pages_total",
        "dsaserve_router_time_to_first_token_seconds_bucket",
    } <= _dashboard_metrics()


def test_dashboard_reads_what_the_router_exports() -> None:
    from prometheus_client import CollectorRegistry

    from dsaserve.services.router.metrics import RouterMetrics

    registry = CollectorRegistry()
    RouterMetrics(registry)
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exported = {
        m.name + suffix for m in registry.collect() for suffix in suffixes.get(m.type, [""])
    }
    wanted = {m for m in _dashboard_metrics() if m.startswith("dsaserve_router_")}
    assert wanted and wanted <= exported, sorted(wanted - exported)


# --- the real CLI ---------------------------------------------------------------------------------

_NO_TORCH = """
import importlib.abc, sys
class _RouterImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "triton", "numpy", "nixl", "nixl_cu12", "nixl_cu13"}:
            raise ImportError(name + " is not in the router image")
sys.meta_path.insert(0, _RouterImage())
"""


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
@pytest.mark.e2e  # a dsaserve command as a process
def test_cli_help_lists_every_contract_flag(role: str) -> None:
    start = (
        "from dsaserve.services.cli import main\n"
        f"sys.argv = ['dsaserve', {role!r}, '--help']\n"
        "sys.exit(main())"
    )
    blocker = _NO_TORCH if role == "router" else ""
    code = f"{blocker}\nimport sys\n{start}"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in sorted(FLAGS[role]):
        assert re.search(rf"--{flag}(?![\w-])", out.stdout), (
            f"`dsaserve {role} --help` has no --{flag}"
        )
