"""The errors a client gets: `APIError` becomes `{"error": {message, type, param, code}}` with its
HTTP status (OpenAI's shape; serve/middleware.py renders it). Anything a client controls raises
one of these, never an assert or a traceback; `bad` and `unsupported` are the 400s of validation.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client gets as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )
        self.headers = headers or {}

    @property
    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param, "unsupported_parameter")
