"""Image references are read the way Docker reads them."""

from __future__ import annotations

import pytest

from aenv.storage.registry_errors import BadReference
from aenv.storage.registry_ref import parse_reference

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(("text", "registry", "repo", "tag", "digest"), [
    ("alpine", "registry-1.docker.io", "library/alpine", "latest", None),
    ("node:20", "registry-1.docker.io", "library/node", "20", None),
    ("docker.io/user/img", "registry-1.docker.io", "user/img", "latest", None),
    ("localhost:5000/x", "localhost:5000", "x", "latest", None),
    ("localhost/x:1", "localhost", "x", "1", None),
    ("127.0.0.1:5000/ns/img:tag", "127.0.0.1:5000", "ns/img", "tag", None),
    ("ghcr.io/org/img@" + D, "ghcr.io", "org/img", None, D),
    ("img:t@" + D, "registry-1.docker.io", "library/img", "t", D),
    ("user/img", "registry-1.docker.io", "user/img", "latest", None),
])
def test_references_expand_as_docker_expands_them(text, registry, repo, tag, digest) -> None:
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)
    assert ref.reference == (digest or tag)


@pytest.mark.parametrize("text", ["", "Alpine", "a b", "img@sha256:xyz", "img@md5:" + "a" * 32,
                                  "a//b", "img:", "host:99x/img"])
def test_malformed_references_are_refused_by_name(text) -> None:
    with pytest.raises(BadReference):
        parse_reference(text)
