"""The chat page: `add_web_ui(app)` serves static/index.html at GET / and the other files of
static/ at GET /static/{name}, nothing else, read once when the routes are added. Every answer
carries a Content-Security-Policy that allows 'self' only (no inline script, no other origin): a
model's answer rendered into the page can neither run script nor load anything. The page needs
no API key to load (it asks for one and sends it on its API calls); the Host check still applies.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
# Route names the API key gate lets through (GET and HEAD only): the page must load to ask for it.
PAGE_ROUTES = ("web_ui", "web_ui_static")
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: an upgraded server serves its own page
}
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def add_web_ui(app: web.Application) -> None:
    """Register GET / and GET /static/{name}. Call it before the router's catch-all (`Unrouted`,
    registered last), which answers every path it is asked about, "/" included."""
    files = {p.name: (p.read_bytes(), CONTENT_TYPES[p.suffix]) for p in _static_files()}
    index = files.pop("index.html")

    async def page(request: web.Request) -> web.Response:
        return _response(*index)

    async def static(request: web.Request) -> web.Response:
        found = files.get(request.match_info["name"])
        if found is None:  # "..", "%2F..", anything not shipped: the errors middleware's 404
            raise web.HTTPNotFound()
        return _response(*found)

    app.router.add_get("/", page, name=PAGE_ROUTES[0])
    app.router.add_get("/static/{name}", static, name=PAGE_ROUTES[1])


def ui_url(host: str, port: int) -> str:
    """The page's address for the start-up banner: a wildcard bind shows the loopback address."""
    host = WILDCARDS.get(host, host)
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _static_files() -> list[Path]:
    return sorted(p for p in STATIC.iterdir() if p.is_file() and p.suffix in CONTENT_TYPES)


def _response(body: bytes, content_type: str) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": content_type, **HEADERS})
