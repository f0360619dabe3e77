"""deploy/k8s: the manifests parse, carry the fields the docs promise (privileged, hostPath
state, /dev, probes on /health, a preStop drain that ends before the grace period, the
API key from the Secret create-api-key.sh makes), name the image the Dockerfile docs build,
and — where kubectl is installed — render with `kubectl kustomize`. No cluster is needed
or used."""

from __future__ import annotations

import base64
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.files import (
    DOCKERFILE,
    INSTALL_DOC,
    K8S,
    env_file_names,
    image_ref,
    parse_dockerfile,
    pyproject,
    variables_aenv_reads,
)

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return load("kustomization.yaml")[0]


@pytest.fixture(scope="module")
def daemonset() -> dict:
    (ds,) = load("daemonset.yaml")
    assert ds["apiVersion"] == "apps/v1" and ds["kind"] == "DaemonSet"
    return ds


@pytest.fixture(scope="module")
def pod(daemonset) -> dict:
    return daemonset["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (c,) = pod["containers"]
    return c


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_kustomization_lists_files_that_exist(kustomization):
    for name in kustomization["resources"]:
        assert (K8S / name).is_file(), name
        assert load(name), f"{name} is empty"
    for gen in kustomization["configMapGenerator"]:
        for env_file in gen["envs"]:
            assert (K8S / env_file).is_file()


def test_everything_lives_in_a_namespace_that_admits_privileged_pods(kustomization):
    (ns,) = load("namespace.yaml")
    assert ns["kind"] == "Namespace"
    assert kustomization["namespace"] == ns["metadata"]["name"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_daemonset_selector_matches_its_pod_labels(daemonset):
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_container_is_privileged(container):
    assert container["securityContext"]["privileged"] is True


def test_state_is_on_the_node_and_dev_is_the_nodes(pod, container):
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/var/lib/aenv"]]["hostPath"] == {
        "path": "/var/lib/aenv", "type": "DirectoryOrCreate"}
    assert volumes[mounts["/dev"]]["hostPath"]["path"] == "/dev"
    assert env_of(container)["AENV_HOME"]["value"] == "/var/lib/aenv"


def test_pod_uses_its_own_network_namespace_with_a_host_port(pod, container):
    """The decision documented in docs/install.md: no hostNetwork, hostPort 3000."""
    assert not pod.get("hostNetwork", False)
    (port,) = container["ports"]
    assert port == {"name": "http", "containerPort": 3000, "hostPort": 3000, "protocol": "TCP"}
    assert env_of(container)["AENV_LISTEN_PORT"]["value"] == "3000"


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_ask_health_on_the_served_port(container, probe):
    get = container[probe]["httpGet"]
    assert get["path"] == "/health"
    assert get["port"] in ("http", 3000)


def test_startup_probe_allows_the_first_start_image_build(container):
    p = container["startupProbe"]
    assert p["periodSeconds"] * p["failureThreshold"] >= 600


def test_prestop_drain_ends_before_the_grace_period(pod, container):
    argv = container["lifecycle"]["preStop"]["exec"]["command"]
    assert argv[0] == "aenv-drain"
    timeout = float(argv[argv.index("--timeout") + 1])
    assert 0 < timeout < pod["terminationGracePeriodSeconds"]


def test_the_image_ships_the_drain_command_on_path():
    copies = [i.args.split() for i in parse_dockerfile(DOCKERFILE.read_text())
              if i.keyword == "COPY"]
    assert ["deploy/bin/aenv-drain", "/usr/local/bin/aenv-drain"] in copies


def test_api_key_comes_from_the_secret_the_script_creates(container):
    ref = env_of(container)["AENV_API_KEY"]["valueFrom"]["secretKeyRef"]
    script = (K8S / "create-api-key.sh").read_text()
    assert ref["name"] == "aenv-api-key" and ref["key"] == "AENV_API_KEY"
    assert "create secret generic aenv-api-key" in script
    assert "--from-literal=AENV_API_KEY=" in script


@needs_kubectl
def test_create_api_key_prints_a_secret_with_a_fresh_key_of_the_servers_form():
    docs = []
    for _ in range(2):
        out = subprocess.run(["bash", str(K8S / "create-api-key.sh"), "--print"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
        docs.append(yaml.safe_load(out))
    keys = [base64.b64decode(d["data"]["AENV_API_KEY"]).decode() for d in docs]
    assert docs[0]["kind"] == "Secret" and docs[0]["metadata"]["name"] == "aenv-api-key"
    assert docs[0]["metadata"]["namespace"] == "aenv-system"
    for key in keys:
        assert key.startswith("e2b_") and len(key) == 44
        int(key[4:], 16)
    assert keys[0] != keys[1]


def test_settings_come_from_the_generated_configmap(kustomization, container):
    (gen,) = kustomization["configMapGenerator"]
    assert container["envFrom"] == [{"configMapRef": {"name": gen["name"]}}]


def test_configmap_settings_are_variables_aenv_reads(kustomization):
    (gen,) = kustomization["configMapGenerator"]
    for env_file in gen["envs"]:
        names = env_file_names(K8S / env_file)
        assert names and names <= variables_aenv_reads(), names - variables_aenv_reads()


def test_headless_service_selects_the_daemonset_pods(daemonset):
    (svc,) = load("service.yaml")
    assert svc["spec"]["clusterIP"] == "None"
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 3000 and port["targetPort"] == "http"


def test_image_is_the_one_the_docs_build(kustomization, container):
    assert container["image"] == image_ref()
    (img,) = kustomization["images"]
    assert img["name"] == image_ref().split(":")[0]
    assert img["newTag"] == pyproject()["project"]["version"]
    assert f"-t {image_ref()} ." in INSTALL_DOC.read_text()


def test_docs_label_nodes_with_the_daemonsets_node_selector(pod):
    ((key, value),) = pod["nodeSelector"].items()
    assert f"kubectl label node NODE {key}={value}" in INSTALL_DOC.read_text()


def test_docs_create_the_secret_the_pods_read():
    doc = INSTALL_DOC.read_text()
    assert "deploy/k8s/create-api-key.sh" in doc
    assert "kubectl create secret generic aenv-api-key" in doc


@needs_kubectl
def test_kustomization_renders_with_kubectl():
    r = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout)}
    config = next(name for kind, name in docs if kind == "ConfigMap")
    assert config.startswith("aenv-config-")
    ds = docs[("DaemonSet", "aenv-node")]
    assert ds["metadata"]["namespace"] == "aenv-system"
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["envFrom"] == [{"configMapRef": {"name": config}}]
    assert c["image"] == image_ref()
    assert set(docs) == {("Namespace", "aenv-system"), ("ConfigMap", config),
                         ("Service", "aenv-nodes"), ("DaemonSet", "aenv-node")}


def test_drain_timeout_in_docs_matches_the_manifest(container):
    argv = container["lifecycle"]["preStop"]["exec"]["command"]
    timeout = argv[argv.index("--timeout") + 1]
    assert f"for at most {timeout} s" in " ".join(INSTALL_DOC.read_text().split())
