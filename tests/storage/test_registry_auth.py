"""The challenge flow of registry_auth through a pull against a fake registry (httpx
MockTransport): bearer tokens fetched once with basic credentials and reused, basic auth,
refusals named, and no credential in any message or log line."""

from __future__ import annotations

import base64
import hashlib
import json
import logging

import httpx
import pytest

from aenv.config import Settings
from aenv.storage.registry import DOCKER_MANIFEST, pull_image
from aenv.storage.registry_auth import RegistryCredentials, parse_challenges
from aenv.storage.registry_errors import AuthFailed, RegistryUnreachable

SECRET = "s3cret-pa55word-never-shown"
CREDS = RegistryCredentials("alice", SECRET)


def _image() -> dict[str, bytes]:
    config = json.dumps({"os": "linux", "architecture": "amd64", "config": {}}).encode()
    layer = b"not really a tar"
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": DOCKER_MANIFEST,
        "config": {"digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                    "digest": "sha256:" + hashlib.sha256(layer).hexdigest(),
                    "size": len(layer)}]}).encode()
    return {"manifest": manifest, "config": config, "layer": layer}


class FakeRegistry:
    """registry.test (HTTPS) wanting a bearer token from auth.test, whose blobs redirect
    to storage.test."""

    def __init__(self, scheme: str = "bearer") -> None:
        self.scheme = scheme
        self.image = _image()
        self.token_requests = 0
        self.seen_auth_off_host: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        auth = request.headers.get("authorization", "")
        if host == "auth.test":
            self.token_requests += 1
            want = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
            if auth != want:
                return httpx.Response(401)
            return httpx.Response(200, json={"token": "tok-123"})
        if host == "storage.test":
            self.seen_auth_off_host.append(auth)
            return httpx.Response(200, content=self.image["layer"])
        ok = auth == "Bearer tok-123" if self.scheme == "bearer" else \
            auth == CREDS.basic()
        if not ok:
            challenge = ('Bearer realm="https://auth.test/token",service="registry.test",'
                         'scope="repository:team/img:pull"' if self.scheme == "bearer"
                         else 'Basic realm="r"')
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        if path.endswith("/manifests/v1"):
            return httpx.Response(200, content=self.image["manifest"],
                                  headers={"Content-Type": DOCKER_MANIFEST})
        digest = path.rsplit("/", 1)[1]
        for name in ("config", "layer"):
            if digest == "sha256:" + hashlib.sha256(self.image[name]).hexdigest():
                if name == "layer":
                    return httpx.Response(307, headers={"Location": "https://storage.test/b"})
                return httpx.Response(200, content=self.image[name])
        return httpx.Response(404)


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home")


def test_challenges_parse_with_quoted_params_and_several_schemes() -> None:
    got = parse_challenges('Bearer realm="https://a/t",service="s",scope="repository:x:pull"'
                           ', Basic realm="r"')
    assert [(c.scheme, c.params) for c in got] == [
        ("bearer", {"realm": "https://a/t", "service": "s", "scope": "repository:x:pull"}),
        ("basic", {"realm": "r"})]


def test_bearer_flow_gets_one_token_and_follows_the_blob_redirect(settings, caplog) -> None:
    fake = FakeRegistry()
    caplog.set_level(logging.DEBUG)
    with pull_image(settings, "registry.test/team/img:v1", credentials=CREDS,
                    transport=httpx.MockTransport(fake)) as image:
        assert image.layers[0].read_bytes() == b"not really a tar"
    assert fake.token_requests == 1
    assert fake.seen_auth_off_host == [""], "the token went to blob storage"
    assert SECRET not in caplog.text and "tok-123" not in caplog.text
    for path in settings.cache_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes()


def test_basic_auth_sends_the_credentials(settings) -> None:
    with pull_image(settings, "registry.test/team/img:v1", credentials=CREDS,
                    transport=httpx.MockTransport(FakeRegistry("basic"))) as image:
        assert len(image.layers) == 1


def test_wrong_password_is_auth_failed_without_the_password(settings) -> None:
    wrong = RegistryCredentials("alice", "wrong-" + SECRET)
    with pytest.raises(AuthFailed, match="refused the credentials") as e, \
            pull_image(settings, "registry.test/team/img:v1", credentials=wrong,
                       transport=httpx.MockTransport(FakeRegistry())):
        pass
    assert SECRET not in str(e.value) and SECRET not in repr(wrong)


def test_basic_without_credentials_says_they_are_needed(settings) -> None:
    with pytest.raises(AuthFailed, match="requires a username and password"), \
            pull_image(settings, "registry.test/team/img:v1",
                       transport=httpx.MockTransport(FakeRegistry("basic"))):
        pass


def test_plain_http_is_refused_for_a_remote_registry(settings) -> None:
    def no_tls(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("TLS handshake failed", request=request)

    with pytest.raises(RegistryUnreachable, match="AENV_INSECURE_REGISTRIES"), \
            pull_image(settings, "registry.test/team/img:v1",
                       transport=httpx.MockTransport(no_tls)):
        pass
