"""Error step: OpenAI-style error bodies and the exceptions that map onto them.

Clients of an OpenAI-compatible server expect `{"error": {"message", "type", "param", "code"}}` with
a matching HTTP status; every failure the router reports goes through `ApiError`.
"""

from __future__ import annotations

from typing import Any

RETRY_AFTER_S = "1"  # on 429 and budget 503s: overload is short-lived, in-flight legs end within seconds

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """A failure with the HTTP status and OpenAI error fields to report it with."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers  # e.g. Retry-After on 429 and 503

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


class LegError(Exception):
    """One leg (prefill or decode) failed; `retryable` says whether a local recompute may help."""

    def __init__(
        self, leg: str, reason: str, message: str, status: int = 502, retryable: bool = True
    ) -> None:
        super().__init__(message)
        self.leg = leg
        self.reason = reason
        self.message = message
        self.status = status
        self.retryable = retryable

    def as_api_error(self) -> ApiError:
        return ApiError(self.status, self.message, code=f"{self.leg}_{self.reason}")
