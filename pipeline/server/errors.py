"""The front end's errors: what a client is told, as OpenAI's error body (their own module, so
that openai_parse.py, openai_render.py and tools.py, which all raise them, need not import
one another for it)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error a client can act on: HTTP status, OpenAI error type, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)


def shutting_down() -> ApiError:
    """The answer to a request this worker will not finish: it is stopping."""
    return ApiError(503, "the server is shutting down; retry", None, "service_unavailable",
                    headers={"Retry-After": "1"})
