"""The cluster's deployment files (issue 18), checked offline as the single-node ones are:
deploy/k8s-cluster (gateway Deployment x2 + Service, Redis StatefulSet, the nodes'
DaemonSet joined to the cluster), deploy/docker-compose.cluster.yml (Redis, two nodes, a
gateway) and the gateway's systemd unit and settings file. They parse, render with
`kubectl kustomize` where kubectl is installed, and agree with each other and with aenv:
every variable they set is a declared setting, every flag is one of the command's own,
every ``$(VAR)`` is defined, ports and the Redis URL match across files. Finally the
gateway runs as they run it: as an unprivileged user, writing nothing."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import typer
import yaml

from aenv.cli.main import app
from aenv.config import Settings
from tests.conftest import ROOT, free_port
from tests.deploy.files import (
    DEPLOY,
    INSTALL,
    INSTALL_DOC,
    env_file_names,
    image_ref,
    parse_unit,
    pyproject,
    variables_aenv_reads,
)

K8S_CLUSTER = DEPLOY / "k8s-cluster"
COMPOSE_CLUSTER = DEPLOY / "docker-compose.cluster.yml"
GATEWAY_UNIT = DEPLOY / "systemd" / "aenv-gateway.service"
GATEWAY_ENV = DEPLOY / "systemd" / "aenv-gateway.env"
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def options_of(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {opt for p in cmd.params for opt in p.opts}


def flags_in(argv: list[str]) -> list[str]:
    """The options in ``argv`` (tini's ``--`` separator is not one)."""
    return [w for w in argv if w.startswith("--") and w != "--"]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def declared_defaults() -> dict[str, str]:
    return {var.name: Settings.default_text(f) for f, var in Settings.variables()}


def accepted(name: str, value: str) -> bool:
    """Whether aenv's settings accept ``value`` for variable ``name``."""
    from aenv.config import SettingsError

    try:
        Settings.from_env({name: value})
    except SettingsError:
        return False
    return True


# -- Kubernetes ---------------------------------------------------------------------------

def k8s(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S_CLUSTER / name).read_text()) if d]


def kind(docs: list[dict[str, Any]], k: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == k]
    return found


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return k8s("kustomization.yaml")[0]


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    text = (K8S_CLUSTER / "cluster.env").read_text()
    return dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", text, re.MULTILINE))


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    r = subprocess.run(["kubectl", "kustomize", str(K8S_CLUSTER)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout)}


def test_the_overlay_builds_on_the_single_node_manifests(kustomization):
    assert kustomization["resources"][0] == "../k8s"
    for name in kustomization["resources"][1:]:
        assert (K8S_CLUSTER / name).is_file() and k8s(name), name
    for p in kustomization["patches"]:
        assert (K8S_CLUSTER / p["path"]).is_file()
    (img,) = kustomization["images"]
    assert img == {"name": "aenv", "newTag": pyproject()["project"]["version"]}
    assert kustomization["namespace"] == k8s("../k8s/namespace.yaml")[0]["metadata"]["name"]


def test_the_cluster_env_is_one_redis_url_aenv_accepts(cluster_env):
    assert set(cluster_env) == {"AENV_CLUSTER"}
    assert accepted("AENV_CLUSTER", cluster_env["AENV_CLUSTER"])


def test_every_variable_the_overlay_sets_is_a_declared_setting():
    texts = [p.read_text() for p in K8S_CLUSTER.iterdir() if p.suffix in (".yaml", ".env")]
    names = {n for t in texts for n in re.findall(r"\bAENV_[A-Z0-9_]+\b", t)}
    assert names and names <= variables_aenv_reads(), names - variables_aenv_reads()
    assert env_file_names(K8S_CLUSTER / "cluster.env") <= variables_aenv_reads()


def test_it_renders_the_gateways_redis_and_nodes_in_one_namespace(rendered):
    kinds = {(k, n.rsplit("-", 1)[0] if k == "ConfigMap" else n) for k, n in rendered}
    assert kinds == {("Namespace", "aenv-system"), ("ConfigMap", "aenv-config"),
                     ("ConfigMap", "aenv-cluster"), ("Service", "aenv-nodes"),
                     ("DaemonSet", "aenv-node"), ("Deployment", "aenv-gateway"),
                     ("Service", "aenv-gateway"), ("StatefulSet", "aenv-redis"),
                     ("Service", "aenv-redis"), ("NetworkPolicy", "aenv-redis")}
    for (k, _), d in rendered.items():
        if k != "Namespace":
            assert d["metadata"]["namespace"] == "aenv-system"


def container_env(c: dict[str, Any], rendered: dict[tuple[str, str], dict[str, Any]]
                  ) -> dict[str, Any]:
    """Everything a container's environment holds: envFrom ConfigMaps' keys (their
    values) and env entries (their specs), in the order Kubernetes defines them."""
    out: dict[str, Any] = {}
    for src in c.get("envFrom", []):
        cm = rendered[("ConfigMap", src["configMapRef"]["name"])]
        out.update(cm["data"])
    for e in c.get("env", []):
        out[e["name"]] = e
    return out


def assert_references_defined(c: dict[str, Any], env: dict[str, Any]) -> None:
    """Every ``$(VAR)`` in command/args is defined; in an env value, defined earlier."""
    for word in [*c.get("command", []), *c.get("args", [])]:
        for ref in re.findall(r"\$\((\w+)\)", word):
            assert ref in env, f"{word}: {ref} undefined"
    seen: set[str] = {k for k, v in env.items() if not isinstance(v, dict)}
    for e in c.get("env", []):
        for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
            assert ref in seen, f"{e['name']}: $({ref}) not defined before it"
        seen.add(e["name"])


def test_nodes_join_the_cluster_advertising_their_pod_ip_on_the_served_port(rendered):
    ds = rendered[("DaemonSet", "aenv-node")]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    env = container_env(c, rendered)
    assert_references_defined(c, env)
    assert c["args"] == ["--cluster", "$(AENV_CLUSTER)"]
    assert set(flags_in(c["args"])) <= options_of("server")
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["AENV_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    advertised = urlsplit(env["AENV_ADVERTISE_URL"]["value"].replace("$(POD_IP)", "10.1.2.3"))
    (port,) = c["ports"]
    assert advertised.scheme == "http" and advertised.hostname == "10.1.2.3"
    assert advertised.port == port["containerPort"] == int(env["AENV_LISTEN_PORT"]["value"])
    secret = env["AENV_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "aenv-cluster-secret", "key": "AENV_CLUSTER_SECRET"}
    # the single-node settings and key are kept; the preStop drains
    assert env["AENV_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "aenv-api-key"
    assert "AENV_MAX_SANDBOXES" in env
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "aenv-drain"


def test_two_gateways_behind_a_service_with_the_clusters_secret_and_key(rendered):
    dep = rendered[("Deployment", "aenv-gateway")]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    env = container_env(c, rendered)
    assert_references_defined(c, env)
    assert c["image"] == image_ref()
    argv = c["command"]
    assert argv[:4] == ["tini", "--", "aenv", "gateway"]
    assert set(flags_in(argv)) <= options_of("gateway")
    assert flag_value(argv, "--cluster") == "$(AENV_CLUSTER)"
    (port,) = c["ports"]
    assert int(flag_value(argv, "--port")) == port["containerPort"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert env["AENV_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "aenv-api-key", "key": "AENV_API_KEY"}
    assert env["AENV_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": "aenv-cluster-secret", "key": "AENV_CLUSTER_SECRET"}
    # unprivileged, read-only: what test_the_gateway_runs_unprivileged_writing_nothing runs
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "privileged" not in c["securityContext"]

    svc = rendered[("Service", "aenv-gateway")]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] == port["name"]
    nodes = rendered[("DaemonSet", "aenv-node")]["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= nodes.items(), "selects the nodes too"


def test_redis_is_a_statefulset_without_persistence_where_the_url_points(rendered):
    sts = rendered[("StatefulSet", "aenv-redis")]
    svc = rendered[("Service", "aenv-redis")]
    cm = next(d for (k, n), d in rendered.items() if k == "ConfigMap"
              and n.startswith("aenv-cluster-"))
    url = urlsplit(cm["data"]["AENV_CLUSTER"])
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] == url.hostname
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    (cport,) = c["ports"]
    (sport,) = svc["spec"]["ports"]
    assert url.port == sport["port"] == cport["containerPort"]
    assert flag_value(c["args"], "--port") == str(cport["containerPort"])
    assert flag_value(c["args"], "--save") == "" and flag_value(c["args"], "--appendonly") == "no"
    assert "volumeClaimTemplates" not in sts["spec"]


def test_only_aenv_pods_reach_redis(rendered):
    pol = rendered[("NetworkPolicy", "aenv-redis")]
    redis_labels = rendered[("StatefulSet", "aenv-redis")]["spec"]["template"]["metadata"]["labels"]
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= redis_labels.items()
    (rule,) = pol["spec"]["ingress"]
    (expr,) = rule["from"][0]["podSelector"]["matchExpressions"]
    components = {rendered[k]["spec"]["template"]["metadata"]["labels"][expr["key"]]
                  for k in (("DaemonSet", "aenv-node"), ("Deployment", "aenv-gateway"))}
    assert expr["operator"] == "In" and set(expr["values"]) == components


@needs_kubectl
def test_create_cluster_secret_prints_a_fresh_secret_aenv_accepts():
    docs = []
    for _ in range(2):
        out = subprocess.run(["bash", str(K8S_CLUSTER / "create-cluster-secret.sh"), "--print"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
        docs.append(yaml.safe_load(out))
    values = [base64.b64decode(d["data"]["AENV_CLUSTER_SECRET"]).decode() for d in docs]
    assert docs[0]["metadata"] == {**docs[0]["metadata"], "name": "aenv-cluster-secret",
                                   "namespace": "aenv-system"}
    assert values[0] != values[1]
    assert all(accepted("AENV_CLUSTER_SECRET", v) for v in values)


# -- Compose ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_CLUSTER.read_text())


def env_values(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def test_compose_runs_redis_two_nodes_and_a_gateway(compose):
    s = compose["services"]
    assert set(s) == {"redis", "node1", "node2", "gateway"}
    single = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["aenv"]
    for name in ("node1", "node2"):
        assert s[name]["build"] == single["build"] and s[name]["image"] == image_ref()
        assert s[name]["privileged"] is True and "redis" in s[name]["depends_on"]
    assert s["gateway"]["image"] == image_ref()
    assert set(s["gateway"]["depends_on"]) == {"redis", "node1", "node2"}
    assert flag_value(s["redis"]["command"], "--save") == ""
    assert flag_value(s["redis"]["command"], "--appendonly") == "no"


def test_compose_variables_are_declared_and_fall_back_to_the_defaults(compose):
    defaults = declared_defaults()
    for name, service in compose["services"].items():
        if name == "redis":
            continue
        for var, value in env_values(service).items():
            assert var in defaults, f"{name}: {var} is not a setting"
            m = re.fullmatch(r"\$\{(\w+)(:-|:\?)(.*)\}", value)
            if m is None:
                assert accepted(var, value), f"{name}: {var}={value}"
                continue
            assert m.group(1) == var, f"{name}: {var}: {value}"
            if m.group(2) == ":-":
                assert m.group(3) == defaults[var], f"{name}: {var} falls back to {m.group(3)}"
    used = set(re.findall(r"\$\{(AENV_[A-Z0-9_]+)", COMPOSE_CLUSTER.read_text()))
    assert used - set(defaults) <= {"AENV_SHM_SIZE"}


def test_compose_nodes_advertise_their_service_and_port_and_share_one_redis(compose):
    s = compose["services"]
    urls = {flag_value(s[n]["command"], "--cluster") for n in ("node1", "node2")}
    urls.add(flag_value(s["gateway"]["command"], "--cluster"))
    (url,) = urls
    assert accepted("AENV_CLUSTER", url)
    parts = urlsplit(url)
    assert parts.hostname == "redis"
    assert parts.port == int(flag_value(s["redis"]["command"], "--port"))
    ids = set()
    for n in ("node1", "node2"):
        env = env_values(s[n])
        adv = urlsplit(env["AENV_ADVERTISE_URL"])
        assert adv.hostname == n and adv.port == 3000
        assert s[n]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{adv.port}/health"
        assert set(flags_in(s[n]["command"])) <= options_of("server")
        ids.add(env["AENV_NODE_ID"])
        assert env["AENV_CLUSTER_SECRET"].startswith("${AENV_CLUSTER_SECRET:?")
        (volume,) = s[n]["volumes"]
        assert volume.split(":")[0] in compose["volumes"]
    assert ids == {"node1", "node2"}
    assert s["node1"]["volumes"] != s["node2"]["volumes"]


def test_compose_publishes_only_the_gateway_on_loopback(compose):
    s = compose["services"]
    gw = s["gateway"]
    argv = [*gw["entrypoint"], *gw["command"]]
    assert argv[:4] == ["tini", "--", "aenv", "gateway"]
    assert set(flags_in(argv)) <= options_of("gateway")
    port = flag_value(argv, "--port")
    assert gw["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert gw["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
    assert all("ports" not in s[n] for n in ("redis", "node1", "node2"))
    env = env_values(gw)
    assert env["AENV_CLUSTER_SECRET"].startswith("${AENV_CLUSTER_SECRET:?")
    assert env["AENV_API_KEY"].startswith("${AENV_API_KEY:?")
    assert gw["read_only"] is True and gw["user"] != "0"


# -- systemd ------------------------------------------------------------------------------

def test_the_gateway_unit_runs_aenv_gateway_unprivileged_from_its_settings_file():
    unit = parse_unit(GATEWAY_UNIT.read_text())
    svc = unit["Service"]
    assert svc["ExecStart"] == ["/opt/aenv/bin/aenv gateway"]
    assert svc["EnvironmentFile"] == ["/etc/default/aenv-gateway"]
    assert svc["DynamicUser"] == ["yes"] and svc["NoNewPrivileges"] == ["yes"]
    assert "AENV_HOME=%S/aenv-gateway" in svc["Environment"]
    assert svc["StateDirectory"] == ["aenv-gateway"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_the_gateway_settings_file_names_what_the_gateway_reads():
    names = env_file_names(GATEWAY_ENV)
    assert {"AENV_LISTEN_HOST", "AENV_LISTEN_PORT", "AENV_CLUSTER", "AENV_CLUSTER_SECRET",
            "AENV_API_KEY", "AENV_LOG_LEVEL"} == names
    values = dict(re.findall(r"^#?(AENV_[A-Z0-9_]+)=(.*)$", GATEWAY_ENV.read_text(),
                             re.MULTILINE))
    defaults = declared_defaults()
    assert {k: v for k, v in values.items() if v and v != defaults[k]} == {}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd not installed")
def test_systemd_analyze_verify_accepts_the_gateway_unit(tmp_path: Path):
    aenv = Path(sys.executable).with_name("aenv")
    env = tmp_path / "aenv-gateway.env"
    env.write_text(GATEWAY_ENV.read_text())
    unit = tmp_path / "aenv-gateway.service"
    unit.write_text(GATEWAY_UNIT.read_text().replace("/opt/aenv/bin/aenv", str(aenv))
                    .replace("/etc/default/aenv-gateway", str(env)))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    complaints = [line for line in (r.stdout + r.stderr).splitlines()
                  if "aenv-gateway.service" in line]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


def test_install_writes_the_gateway_unit_and_settings_without_enabling_them(tmp_path: Path):
    r = subprocess.run(["bash", str(INSTALL), "--dry-run", "--skip-packages"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "would write /etc/systemd/system/aenv-gateway.service" in r.stdout
    assert ("would write /etc/default/aenv-gateway" in r.stdout
            or "keeping /etc/default/aenv-gateway" in r.stdout)
    assert "enable aenv-gateway" not in r.stdout


# -- the gateway as all three run it --------------------------------------------------------

@pytest.mark.slow  # a gateway process: seconds of imports and start-up
def test_the_gateway_runs_writing_nothing(tmp_path: Path):
    """As the manifests run it (read-only root, a home it need not write: the key comes
    from AENV_API_KEY): it serves /health and leaves its home empty. (Not as uid 65534
    here: this checkout's interpreter lives under /root.)"""
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    env = {"PATH": os.environ["PATH"], "AENV_HOME": str(home), "AENV_LISTEN_PORT": str(port),
           "AENV_CLUSTER": "redis://127.0.0.1:1/0", "AENV_CLUSTER_SECRET": "s" * 40,
           "AENV_API_KEY": "e2b_" + "1" * 40}
    proc = subprocess.Popen([sys.executable, "-m", "aenv.cli.main", "gateway"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 204:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(15)
    assert list(home.iterdir()) == []


def test_docs_walk_through_each_cluster_deployment():
    doc = " ".join(INSTALL_DOC.read_text().split())
    for needed in ("kubectl apply -k deploy/k8s-cluster",
                   "deploy/k8s-cluster/create-cluster-secret.sh",
                   "docker compose -f deploy/docker-compose.cluster.yml up",
                   "deploy/systemd/aenv-gateway.service", "/etc/default/aenv-gateway",
                   "make cluster", "make cluster-stop"):
        assert needed in doc, needed
