"""The dashboard's mount: pages at /ui/, `/` redirects there, only the listed npm files are served,
and a missing charting library is a clear 404 the page can explain (no browser needed here)."""

import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.dashboard import mount_dashboard
from service.dashboard.mount import NODE_MODULES_DIR, STATIC_DIR


def make_client(**kwargs: object) -> TestClient:
    app = FastAPI()
    mount_dashboard(app, **kwargs)
    return TestClient(app)


def test_root_redirects_to_the_dashboard() -> None:
    response = make_client().get("/", follow_redirects=False)
    assert response.status_code == 307
    assert response.headers["location"] == "/ui/"


def test_an_existing_root_route_is_kept() -> None:
    app = FastAPI()
    app.add_api_route("/", lambda: {"hello": "world"})
    mount_dashboard(app)
    assert TestClient(app).get("/").json() == {"hello": "world"}


def test_index_and_modules_are_served_without_stale_caching() -> None:
    client = make_client()
    index = client.get("/ui/")
    assert index.status_code == 200
    assert '<script type="module" src="/ui/static/app.js">' in index.text
    module = client.get("/ui/static/pages/job.js")
    assert module.status_code == 200
    assert module.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert module.headers["cache-control"] == "no-cache"


def test_every_name_the_pages_import_exists() -> None:
    """A typo in an import would blank the page in the browser; catch it without one."""
    for script in STATIC_DIR.rglob("*.js"):
        for names, target in re.findall(r'import \{([^}]*)\} from "(\.{1,2}/[^"]+)"', script.read_text()):
            module = (script.parent / target).resolve()
            assert module.is_file(), f"{script.name} imports missing {target}"
            exported = set(re.findall(r"export (?:async )?(?:function|const|class|let) (\w+)", module.read_text()))
            for name in filter(None, (n.strip() for n in names.split(","))):
                assert name in exported, f"{script.name} imports {name} that {target} does not export"


def test_missing_chart_library_is_a_404_naming_the_install_step(tmp_path: Path) -> None:
    response = make_client(node_modules=tmp_path).get("/ui/vendor/uPlot.esm.js")
    assert response.status_code == 404
    assert response.text == "uPlot.esm.js is not installed: run `npm ci --prefix service/dashboard`"


def test_only_listed_vendor_files_are_served(tmp_path: Path) -> None:
    (tmp_path / "uplot" / "dist").mkdir(parents=True)
    (tmp_path / "uplot" / "dist" / "uPlot.esm.js").write_text("export default 1;")
    (tmp_path / "secret.txt").write_text("nope")
    client = make_client(node_modules=tmp_path)
    assert client.get("/ui/vendor/uPlot.esm.js").text == "export default 1;"
    assert client.get("/ui/vendor/secret.txt").status_code == 404
    assert client.get("/ui/vendor/..%2Fsecret.txt").status_code == 404


@pytest.mark.skipif(not (NODE_MODULES_DIR / "uplot").is_dir(), reason="run `npm ci --prefix service/dashboard`")
def test_installed_chart_library_is_served() -> None:
    response = make_client().get("/ui/vendor/uPlot.esm.js")
    assert response.status_code == 200
    assert "export { uPlot as default }" in response.text
