"""OpenAI-style errors: every failure the router reports is ``{"error": {message, type, code}}``."""

from __future__ import annotations

from collections.abc import Mapping

import orjson


class RouterError(Exception):
    """An error with the HTTP status and OpenAI error fields the client should see."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        error_type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type
        self.headers = dict(headers or {})
        self.param = param

    def payload(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code, "param": self.param}}

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def sse_event(self) -> bytes:
        """The error as one server-sent event, for failures after a stream has started."""
        return b"data: " + self.body() + b"\n\n"


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> RouterError:
    return RouterError(400, message, code, param=param)


def model_not_found(model: str) -> RouterError:
    return RouterError(404, f"The model `{model}` does not exist.", "model_not_found", param="model")


def too_large(limit: int) -> RouterError:
    return RouterError(413, f"Request body larger than {limit} bytes.", "request_too_large")


def queue_full(retry_after_seconds: int) -> RouterError:
    return RouterError(
        429,
        "The router's admission queue is full; retry later.",
        "queue_full",
        error_type="rate_limit_error",
        headers={"Retry-After": str(retry_after_seconds)},
    )


def no_capacity(pool: str, waited: float) -> RouterError:
    code = "no_decode_capacity" if pool == "decode" else f"no_{pool}_capacity"
    return RouterError(
        503,
        f"No {pool} worker became available within {waited:g} s.",
        code,
        error_type="service_unavailable_error",
        headers={"Retry-After": "1"},
    )


def upstream_failed(message: str, code: str = "upstream_error", status: int = 502) -> RouterError:
    return RouterError(status, message, code, error_type="upstream_error")


def draining() -> RouterError:
    return RouterError(503, "The router is shutting down.", "shutting_down", error_type="service_unavailable_error")
