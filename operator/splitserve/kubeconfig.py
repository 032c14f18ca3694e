"""Credentials for the Kubernetes API, shared by the operator and the router.

Loaded by the `kubernetes` client's own loaders (in-cluster service account, or a kubeconfig with its
tokens, client certificates and exec credential plugins), then used by our own HTTP clients (httpx in
the operator, aiohttp in the router). The Authorization header is asked again for every connection or
request: the loaders' refresh hooks re-read a rotated service-account token and re-run an exec plugin
whose token expired.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class KubeAccess:
    """How to reach the Kubernetes API: base URL, TLS context, and the Authorization header.

    The header comes from `authorization` when set (credentials loaded by the `kubernetes` client,
    asked again for each connection so rotated service-account tokens and expired exec-plugin
    tokens are renewed), else from a fixed `token` or a `token_file` read for each connection.
    """

    server: str
    ssl_context: ssl.SSLContext | bool
    token: str | None = None
    token_file: str | None = None
    authorization: Callable[[], str | None] | None = None

    def headers(self) -> dict[str, str]:
        if self.authorization is not None:
            value = self.authorization()
            return {"Authorization": value} if value else {}
        token = self.token
        if self.token_file:
            with open(self.token_file) as handle:
                token = handle.read().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}


def authorization_header(api_key: str | None) -> str | None:
    """The client's stored key as a header value: it keeps the scheme it was loaded with
    ("Bearer x", the in-cluster loader's "bearer x", "Basic x"); a bare token is a bearer token."""
    if not api_key or not api_key.strip():
        return None
    scheme, _, credentials = api_key.strip().partition(" ")
    if not credentials:
        return f"Bearer {scheme}"
    if scheme.lower() == "bearer":
        return f"Bearer {credentials.strip()}"
    return f"{scheme} {credentials.strip()}"


def access_from_configuration(configuration: Any) -> KubeAccess:
    """KubeAccess from a loaded `kubernetes.client.Configuration` (host, TLS files, API key and its refresh hook)."""
    server = str(configuration.host or "").rstrip("/")
    ssl_context: ssl.SSLContext | bool = False
    if server.startswith("https"):
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
        if not configuration.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file or None)
        ssl_context = context

    def authorization() -> str | None:
        # get_api_key_with_prefix runs the loader's refresh hook first (token file re-read, exec plugin re-run).
        key: str | None = configuration.get_api_key_with_prefix("BearerToken")
        return authorization_header(key)

    return KubeAccess(server, ssl_context, authorization=authorization)


def in_cluster_access() -> KubeAccess:
    """The pod's service account, through `kubernetes.config.load_incluster_config` (the token
    re-read as it rotates)."""
    from kubernetes import client, config  # imported lazily: slow, and only kubernetes discovery needs it

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except config.ConfigException as error:
        raise RuntimeError(f"not in a cluster: {error} (give --kubeconfig)") from error
    return access_from_configuration(configuration)


def kubeconfig_access(path: str | None = None) -> KubeAccess:
    """The current context of a kubeconfig (default: $KUBECONFIG or ~/.kube/config), through
    `kubernetes.config.load_kube_config`: tokens, client certificates and exec credential plugins."""
    from kubernetes import client, config

    configuration = client.Configuration()
    configuration.host = ""  # the loader sets it only when the context's cluster names a server
    where = f"kubeconfig {path}" if path else "kubeconfig"
    try:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=configuration, persist_config=False
        )
    except config.ConfigException as error:
        raise RuntimeError(f"{where}: {error}") from error
    if not configuration.host:
        raise RuntimeError(f"{where}: no server for the current context")
    return access_from_configuration(configuration)


def load_access(kubeconfig: str | None = None) -> KubeAccess:
    """`kubeconfig` when given; else the in-cluster service account, then the default kubeconfig
    (the operator and the router alike)."""
    if kubeconfig:
        return kubeconfig_access(kubeconfig)
    try:
        return in_cluster_access()
    except RuntimeError as in_cluster:
        try:
            return kubeconfig_access()
        except RuntimeError as error:
            raise RuntimeError(f"{in_cluster}; and no usable default kubeconfig: {error}") from error
