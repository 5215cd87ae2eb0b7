"""The no-token rule, enforced on each request's peer address: whatever binds the socket, a service without
a (long enough) token answers only this machine.

``FERRY_HOST`` is checked at start-up, but ``uvicorn service.app:app --host 0.0.0.0`` (or a container's
port mapping) binds the socket without going through it. The peer address the server reports cannot be
bypassed that way.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response
from .settings import MIN_TOKEN_LENGTH


def is_remote_peer(host: str | None) -> bool:
    """True for a peer reached over the network from another machine.

    Servers report a TCP peer as an IP literal. No address (a Unix socket) or a name (an in-process test
    client) is no network peer at all.
    """
    if host is None:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return not (mapped or address).is_loopback


class LoopbackOnlyMiddleware:
    """Refuse (403) every request from another machine unless a token of ``MIN_TOKEN_LENGTH`` is set."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.refusal = _refusal(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.refusal is not None and scope["type"] == "http":
            client = scope.get("client")
            if is_remote_peer(client[0] if client else None):
                await error_response(403, "loopback_only", self.refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(token: str | None) -> str | None:
    if not token:
        return (
            "This service has no FERRY_API_TOKEN, so it answers only this machine (loopback). To serve other "
            "machines, start it with FERRY_API_TOKEN set to a long random string (openssl rand -hex 32)."
        )
    if len(token) < MIN_TOKEN_LENGTH:
        return (
            f"This service's FERRY_API_TOKEN is shorter than {MIN_TOKEN_LENGTH} characters, so it answers only "
            "this machine (loopback). Set a longer one (openssl rand -hex 32) to serve other machines."
        )
    return None
