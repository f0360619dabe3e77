"""ApiClient turns a 2xx answer that is not the JSON shape it promises into an ApiError
(its contract: every failure is an ApiError), instead of a ValueError or a wrong type."""

from __future__ import annotations

import httpx
import pytest

from aenv.client.api import ApiClient, ApiError


def _client(status: int, content: bytes, ctype: str = "application/json") -> ApiClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=content, headers={"content-type": ctype})

    return ApiClient("http://aenv.test", "key", transport=httpx.MockTransport(answer))


def test_an_object_answer_is_returned_as_a_dict() -> None:
    with _client(200, b'{"sandboxID": "s1"}') as api:
        assert api.get_sandbox("s1") == {"sandboxID": "s1"}


def test_a_non_json_answer_is_an_api_error() -> None:
    with _client(200, b"<html>proxy</html>", "text/html") as api, \
            pytest.raises(ApiError, match="not JSON"):
        api.get_sandbox("s1")


def test_a_list_where_an_object_belongs_is_an_api_error() -> None:
    with _client(200, b"[]") as api, pytest.raises(ApiError, match="not a JSON object"):
        api.get_sandbox("s1")


def test_a_list_answer_must_hold_objects() -> None:
    with _client(200, b'[{"templateID": "t"}, 3]') as api, \
            pytest.raises(ApiError, match="list of objects"):
        api.list_templates()
    with _client(200, b'[{"templateID": "t"}]') as api:
        assert api.list_templates() == [{"templateID": "t"}]
