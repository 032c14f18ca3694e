"""A small async client for Prometheus' HTTP query API (`/api/v1/query`).

Only instant queries: the autoscaler and the diagnosis read "the value now" and let PromQL
(`rate`, `histogram_quantile`, `max_over_time`) do any windowing server-side.

Errors are folded into one exception, `PrometheusUnavailable`, because every caller reacts the
same way: hold what it has and say why. "No data" is not an error: it is `None` (scalar) or an
empty mapping (vector), so a caller can tell "the server is down" from "nothing is exported yet".
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any, Self

import httpx

Labels = frozenset[tuple[str, str]]

DEFAULT_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


def shared_http_client() -> httpx.AsyncClient:
    """One pooled HTTP client for many PrometheusClients: each new one costs a TLS context (tens of ms of
    CPU), which per InferenceDeployment and per timer run adds up to most of an operator's CPU."""
    return httpx.AsyncClient(timeout=DEFAULT_TIMEOUT)


class PrometheusUnavailable(Exception):
    """Prometheus could not be reached, timed out, or answered with an error."""


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def labels_of(metric: dict[str, str], *, keep_name: bool = False) -> Labels:
    return frozenset((k, v) for k, v in metric.items() if keep_name or k != "__name__")


class PrometheusClient:
    """Async Prometheus query client; use as `async with PrometheusClient(url) as client:`.

    Pass `http` to share an existing `httpx.AsyncClient` (the caller then owns and closes it).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        http: httpx.AsyncClient | None = None,
        at: float | None = None,
    ) -> None:
        """`at`: evaluate every instant query at this Unix time instead of now (a window that ended then)."""
        self.base_url = base_url.rstrip("/")
        self.at = at
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._timeout = timeout

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def _query(self, promql: str) -> dict[str, Any]:
        """Run an instant query and return its `data` object (resultType + result)."""
        url = f"{self.base_url}/api/v1/query"
        try:
            form = {"query": promql} if self.at is None else {"query": promql, "time": f"{self.at:.3f}"}
            response = await self._http.post(url, data=form, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(f"cannot reach Prometheus at {self.base_url}: {exc!r}") from exc
        try:
            body = response.json()
        except ValueError as exc:
            raise PrometheusUnavailable(
                f"Prometheus at {self.base_url} answered HTTP {response.status_code} with a non-JSON body"
            ) from exc
        if response.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error", "") if isinstance(body, dict) else ""
            error_type = body.get("errorType", "") if isinstance(body, dict) else ""
            raise PrometheusUnavailable(
                f"Prometheus at {self.base_url} rejected query {promql!r}: HTTP {response.status_code} "
                f"{error_type}: {error}".rstrip(": ")
            )
        data = body.get("data")
        if not isinstance(data, dict):
            raise PrometheusUnavailable(f"Prometheus at {self.base_url} answered without a data object")
        return data

    async def query_vector(self, promql: str) -> dict[Labels, float]:
        """Instant query → {label set (without __name__): value}. NaN/Inf samples are dropped.

        A scalar result is returned as one entry keyed by the empty label set.
        """
        data = await self._query(promql)
        result_type = data.get("resultType")
        result = data.get("result")
        out: dict[Labels, float] = {}
        if result_type == "scalar" and isinstance(result, list) and len(result) == 2:
            value = finite_or_none(float(result[1]))
            if value is not None:
                out[frozenset()] = value
            return out
        if result_type != "vector" or not isinstance(result, list):
            raise PrometheusUnavailable(
                f"query {promql!r} returned a {result_type!r}; an instant vector or scalar was expected"
            )
        for sample in result:
            metric = sample.get("metric", {})
            value = finite_or_none(float(sample["value"][1]))
            if value is not None:
                out[labels_of(metric)] = value
        return out

    async def query_scalar(self, promql: str) -> float | None:
        """Instant query expected to yield one number. None when there is no series or it is NaN/Inf.

        If the query yields several series their values are summed (write `sum(...)` to be explicit).
        """
        vector = await self.query_vector(promql)
        if not vector:
            return None
        return sum(vector.values())

    async def is_ready(self) -> bool:
        try:
            response = await self._http.get(f"{self.base_url}/-/ready", timeout=self._timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
