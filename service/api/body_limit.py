"""Refuse request bodies over the limit before they are read into memory."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.openai.errors import is_openai_path


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Pure ASGI: checks Content-Length up front and counts chunked bodies as they arrive.

    ``path_limits`` gives a path a limit of its own, with the setting that raises it (the uploads route:
    ``{"/v1/files": (max_upload_bytes, "FERRY_MAX_UPLOAD_BYTES")}``).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, *, path_limits: dict[str, tuple[int, str]] | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):  # no route reads a GET's body
            await self.app(scope, receive, send)
            return
        limit, setting = self.path_limits.get(scope["path"], (self.max_bytes, "FERRY_MAX_BODY_BYTES"))
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, limit, setting, scope["path"])
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send, limit, setting, scope["path"])

    async def _refuse(self, send: Send, limit: int, setting: str, path: str) -> None:
        what = "file" if setting != "FERRY_MAX_BODY_BYTES" else "spec"
        message = f"The request body is larger than {limit} bytes; send a smaller {what} or raise {setting}."
        error: dict[str, str | None] = {"code": "body_too_large", "message": message}
        if is_openai_path(path):  # OpenAI's envelope on its routes
            what = "request" if what == "spec" else what
            message = f"The request body is larger than {limit} bytes; send a smaller {what} or raise {setting}."
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": "body_too_large"}
        body = json.dumps({"error": error}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
