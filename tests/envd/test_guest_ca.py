"""The node's egress CA in a guest (``GuestHooks.trust_ca``): added to the system bundle
once, and the variables that make runtimes with CA lists of their own (Node.js, certifi)
trust it, set only where they cannot cost a sandbox its public roots."""

from __future__ import annotations

from pathlib import Path

from aenv.egress.ca import EgressCA
from aenv.envd.guest import GuestHooks
from aenv.envd.state import EnvdState

PUBLIC_ROOT = "-----BEGIN CERTIFICATE-----\nMIIBpublic\n-----END CERTIFICATE-----\n"


def _paths(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "certs" / "bundle.crt"), str(tmp_path / "local" / "aenv.crt")


def _public_bundle(tmp_path: Path) -> tuple[str, str]:
    """Paths as ``_paths``, the bundle holding a public root (an image with
    ``ca-certificates``)."""
    bundle, source = _paths(tmp_path)
    Path(bundle).parent.mkdir(parents=True)
    Path(bundle).write_text(PUBLIC_ROOT)
    return bundle, source


def _node_ca(tmp_path: Path) -> str:
    return EgressCA(tmp_path / "ca").pem


def test_a_bundle_with_public_roots_gets_the_ca_once_and_all_three_variables(
        tmp_path: Path) -> None:
    bundle, source = _public_bundle(tmp_path)
    pem = _node_ca(tmp_path)
    hooks = GuestHooks(enabled=True)
    first = hooks.trust_ca(pem, bundle, source)
    again = hooks.trust_ca(pem, bundle, source)     # every /init, after every resume
    assert first == again == {"NODE_EXTRA_CA_CERTS": source, "REQUESTS_CA_BUNDLE": bundle,
                              "SSL_CERT_FILE": bundle}
    text = Path(bundle).read_text()
    assert text.startswith(PUBLIC_ROOT) and text.count(pem.strip()) == 1
    assert Path(source).read_text().strip() == pem.strip()


def test_an_image_without_public_roots_gets_only_the_additive_variable(tmp_path: Path) -> None:
    bundle, source = _paths(tmp_path)
    pem = _node_ca(tmp_path)
    hooks = GuestHooks(enabled=True)
    for _ in range(2):
        assert hooks.trust_ca(pem, bundle, source) == {"NODE_EXTRA_CA_CERTS": source}
    assert Path(bundle).read_text().count("BEGIN CERTIFICATE") == 1


def test_on_a_host_nothing_is_touched_and_nothing_is_set(tmp_path: Path) -> None:
    bundle, source = _paths(tmp_path)
    assert GuestHooks().trust_ca(_node_ca(tmp_path), bundle, source) == {}
    assert GuestHooks(enabled=True).trust_ca("not a pem", bundle, source) == {}
    assert not Path(bundle).exists() and not Path(source).exists()


def test_the_sandboxs_env_vars_win_over_envds_ca_variables() -> None:
    state = EnvdState(env_vars={"REQUESTS_CA_BUNDLE": "/mine.pem", "A": "1"},
                      tls_env={"REQUESTS_CA_BUNDLE": "/b", "NODE_EXTRA_CA_CERTS": "/c"})
    assert state.process_env() == {"REQUESTS_CA_BUNDLE": "/mine.pem", "A": "1",
                                   "NODE_EXTRA_CA_CERTS": "/c"}


def test_the_same_ca_again_does_not_read_the_bundle_while_it_is_unchanged(
        tmp_path: Path, monkeypatch) -> None:
    """Every /init after a restore brings the CA the snapshot's guest trusted already."""
    import builtins

    from aenv.envd import guest

    bundle, source = _public_bundle(tmp_path)
    pem = _node_ca(tmp_path)
    hooks = GuestHooks(enabled=True)
    first = hooks.trust_ca(pem, bundle, source)
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(guest, "open", counting_open, raising=False)
    assert hooks.trust_ca(pem, bundle, source) == first
    assert opened == []
    # the image's own tools rewrote the bundle without it: added again
    Path(bundle).write_text(PUBLIC_ROOT + PUBLIC_ROOT)
    assert hooks.trust_ca(pem, bundle, source) == first
    assert bundle in opened
    assert Path(bundle).read_text().count(pem.strip()) == 1
