"""The browser dashboard: static pages served by the service itself, reading the same REST API.

Example:
    from service.dashboard import mount_dashboard

    app = FastAPI()
    mount_dashboard(app)        # pages at /ui/, `/` redirects there
"""

from service.dashboard.mount import DASHBOARD_PREFIX, mount_dashboard

__all__ = ["DASHBOARD_PREFIX", "mount_dashboard"]
