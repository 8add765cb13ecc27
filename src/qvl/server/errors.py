"""Every error the server answers, in OpenAI's shape, and the one place exceptions become HTTP."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from qvl.engine import RequestError
from qvl.processing.image import ImageError

log = logging.getLogger("qvl.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         421: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An answer other than success: HTTP status plus OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, ollama: bool = False) -> JSONResponse:
        """OpenAI's shape, or Ollama's {"error": "message"} on its routes."""
        body = {"error": self.message} if ollama else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
    return out or None


def from_validation(exc: ValidationError) -> APIError:
    """The first problem pydantic found, named by its path in the request body."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}",
                           code="invalid_json")
    param = loc_to_param(tuple(first["loc"]))
    message = first["msg"].removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param, first["type"])


def from_exception(exc: BaseException) -> APIError:
    """Map what the engine and the image code raise for bad input; anything else is a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation(exc)
    if isinstance(exc, RequestError):
        return bad_request(str(exc), exc.param, exc.code)
    if isinstance(exc, ImageError):
        return bad_request(str(exc), "messages", "invalid_image")
    if isinstance(exc, ValueError):  # SamplingParams range checks and other input checks
        return bad_request(str(exc))
    return internal(exc)


def internal(exc: BaseException) -> APIError:
    """A bug or a resource problem: logged with its traceback, answered with a 500."""
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def is_ollama(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def install(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into error responses: OpenAI's shape, and
    Ollama's under /api/."""

    async def api_error(request: Request, exc: Exception):
        return from_exception(exc).response(is_ollama(request))

    async def http_error(request: Request, exc: HTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response(is_ollama(request))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, api_error)
