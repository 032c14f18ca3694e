"""API errors rendered as meta/v1 Status objects, the way clients (kopf, kubectl) parse them."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(kind_plural: str, name: str, group: str) -> dict[str, Any]:
    return {"name": name, "group": group, "kind": kind_plural}


def not_found(group: str, plural: str, name: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found', details=_details(plural, name, group))


def already_exists(group: str, plural: str, name: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(409, "AlreadyExists", f'{qualified} "{name}" already exists', details=_details(plural, name, group))


def conflict(group: str, plural: str, name: str, why: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified} "{name}": {why}',
        details=_details(plural, name, group),
    )


def invalid(message: str) -> ApiError:
    return ApiError(422, "Invalid", message)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def success_status(details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
    if details:
        body["details"] = details
    return body
