"""Who may talk to the service, checked before anything reads the request: the peer and the bearer token.

The no-token rule is enforced on each request's peer address: whatever binds the socket, a service without
a (long enough) token answers only this machine. ``FERRY_HOST`` is checked at start-up, but
``uvicorn service.api.app:app --host 0.0.0.0`` (or a container's port mapping) binds the socket without going
through it; the peer address the server reports cannot be bypassed that way.

With FERRY_API_TOKEN set, every ``/v1`` route and ``/metrics`` need ``Authorization: Bearer <token>``.
Both checks are one pure-ASGI layer rather than a FastAPI dependency: resolving a dependency costs more
than the hot polls' own work (bench/profile_requests.py).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.openai.errors import envelope_for
from service.settings import MIN_TOKEN_LENGTH


@functools.lru_cache(maxsize=1024)  # a handful of peers poll many times a second
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


class AccessMiddleware:
    """Refuse (403) every request from another machine unless a token of ``MIN_TOKEN_LENGTH`` is set, and
    (401) a ``/v1`` or ``/metrics`` request without the token when one is set."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.refusal = _refusal(token)
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            client = scope.get("client")
            if self.refusal is not None and is_remote_peer(client[0] if client else None):
                await envelope_for(scope["path"], 403, "loopback_only", self.refusal)(scope, receive, send)
                return
            if self.token is not None and _needs_token(scope["path"]):
                problem = self._token_problem(scope)
                if problem is not None:
                    answer = envelope_for(
                        scope["path"], 401, "unauthorized", problem, headers={"WWW-Authenticate": "Bearer"}
                    )
                    await answer(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _token_problem(self, scope: Scope) -> str | None:
        assert self.token is not None
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, credentials = given.partition(b" ")
        if scheme.lower() != b"bearer" or not credentials:
            return (
                "This service needs a token: send the header "
                "'Authorization: Bearer <token>' with the value of FERRY_API_TOKEN."
            )
        # Constant time: how much of a guess matches must not show in the response time.
        if not hmac.compare_digest(credentials.strip(), self.token):
            return "The bearer token is wrong; send the value of FERRY_API_TOKEN."
        return None


def _needs_token(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path == "/metrics"


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
