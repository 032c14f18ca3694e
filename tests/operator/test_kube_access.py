"""The operator's API client asks its credentials (splitserve.kubeconfig, shared with the router) for
the Authorization header on every request, so a rotated service-account token is picked up."""

from __future__ import annotations

from pathlib import Path

import httpx

from splitserve.io.kube import KubeAuth
from splitserve.kubeconfig import KubeAccess, authorization_header


def test_the_in_cluster_loaders_lower_case_scheme_becomes_one_bearer() -> None:
    # load_incluster_config stores "bearer <token>"; the header must not read "Bearer bearer <token>".
    assert authorization_header("bearer abc") == "Bearer abc"
    assert authorization_header("abc") == "Bearer abc"


def test_a_rotated_service_account_token_is_used_from_the_next_request(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["Authorization"])
        return httpx.Response(200, json={})

    access = KubeAccess("https://cluster.example", False, token_file=str(token))
    with httpx.Client(transport=httpx.MockTransport(server), auth=KubeAuth(access)) as client:
        client.get("https://cluster.example/api")
        token.write_text("second\n")  # the kubelet rotated it
        client.get("https://cluster.example/api")
    assert seen == ["Bearer first", "Bearer second"]


def test_a_refreshing_loader_is_asked_each_time() -> None:
    issued = iter(["Bearer one", "Bearer two"])
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["Authorization"])
        return httpx.Response(200, json={})

    access = KubeAccess("https://cluster.example", False, authorization=lambda: next(issued))
    with httpx.Client(transport=httpx.MockTransport(server), auth=KubeAuth(access)) as client:
        client.get("https://cluster.example/api")
        client.get("https://cluster.example/api")
    assert seen == ["Bearer one", "Bearer two"]
