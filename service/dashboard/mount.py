"""Mounts the dashboard's static files and its charting library into a FastAPI app.

The pages are plain ES modules, so there is no build step. The one third-party browser library (uPlot,
for the charts) comes from npm into `service/dashboard/node_modules` via `npm ci --prefix
service/dashboard`; when it is absent the dashboard still works and says, where a chart would be, which
command installs it.
"""

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

logger = logging.getLogger(__name__)

DASHBOARD_PREFIX = "/ui"
PACKAGE_DIR = Path(__file__).resolve().parent
STATIC_DIR = PACKAGE_DIR / "static"
NODE_MODULES_DIR = PACKAGE_DIR / "node_modules"

# The only files served from node_modules: an explicit list, so nothing else under it is reachable.
VENDOR_FILES = {
    "uPlot.esm.js": "uplot/dist/uPlot.esm.js",
    "uPlot.min.css": "uplot/dist/uPlot.min.css",
}

# Pages and scripts change with the code; make the browser revalidate instead of caching stale modules.
NO_CACHE = {"Cache-Control": "no-cache"}


def mount_dashboard(app: FastAPI, *, node_modules: Path = NODE_MODULES_DIR) -> None:
    """Serve the dashboard at `/ui/` and redirect `/` there (unless the app already answers `/`).

    The pages themselves hold no data and need no token; every figure they show comes from `/v1`,
    which the browser calls with the token the user typed in.

    Args:
        app: the service's FastAPI app.
        node_modules: where `npm ci` put the dashboard's browser dependencies.
    """
    _warn_if_charts_missing(node_modules)
    _add_vendor_route(app, node_modules)
    _add_index_routes(app)
    app.mount(f"{DASHBOARD_PREFIX}/static", _NoCacheStatic(directory=STATIC_DIR), name="dashboard-static")


def _add_index_routes(app: FastAPI) -> None:
    index = STATIC_DIR / "index.html"

    async def read_dashboard() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=NO_CACHE)

    async def redirect_to_dashboard() -> RedirectResponse:
        return RedirectResponse(f"{DASHBOARD_PREFIX}/", status_code=307)

    app.add_api_route(f"{DASHBOARD_PREFIX}/", read_dashboard, methods=["GET"], include_in_schema=False)
    app.add_api_route(DASHBOARD_PREFIX, redirect_to_dashboard, methods=["GET"], include_in_schema=False)
    if not any(getattr(route, "path", None) == "/" for route in app.routes):
        app.add_api_route("/", redirect_to_dashboard, methods=["GET"], include_in_schema=False)


def _add_vendor_route(app: FastAPI, node_modules: Path) -> None:
    async def read_vendor_file(name: str) -> Response:
        relative = VENDOR_FILES.get(name)
        path = node_modules / relative if relative else None
        if path is None or not path.is_file():
            # The page catches this and shows how to install the charting library.
            return Response(
                f"{name} is not installed: run `npm ci --prefix service/dashboard`",
                status_code=404,
                media_type="text/plain",
            )
        return FileResponse(path, headers=NO_CACHE)

    app.add_api_route(f"{DASHBOARD_PREFIX}/vendor/{{name}}", read_vendor_file, methods=["GET"], include_in_schema=False)


def _warn_if_charts_missing(node_modules: Path) -> None:
    if not all((node_modules / relative).is_file() for relative in VENDOR_FILES.values()):
        logger.warning(
            "dashboard charts are off: uPlot is not installed under %s; run `npm ci --prefix service/dashboard`",
            node_modules,
        )


class _NoCacheStatic(StaticFiles):
    """StaticFiles that asks browsers to revalidate, so a code update is never half-applied."""

    def file_response(self, *args, **kwargs) -> Response:  # type: ignore[no-untyped-def]
        response = super().file_response(*args, **kwargs)
        response.headers.update(NO_CACHE)
        return response
