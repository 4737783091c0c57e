"""The chat page (serve/web_ui.py). Through the app and its middleware: GET / and /static/ answer
with the Content-Security-Policy, nothing outside static/ is served, the page loads without the
API key while /v1 needs it, the Host check applies. In a real headless Chromium (Debian's
`chromium` driven by Playwright; skipped without them) against a `tinyserve run` process on
SmolLM2: an answer streams in, Stop aborts a long one (the server counts it aborted), a reload
shows the conversation again; the screenshot is kept under the test's tmp_path.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import urllib.request

import pytest
from process_helpers import Server
from test_server import serving

from tinyserve.serve.web_ui import HEADERS, ui_url

pytestmark = pytest.mark.slow

KEY = "page-key-123"
CSP = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


async def raw_get(client, path: str, host: str = "localhost") -> tuple[int, str]:
    """GET over a raw socket, so nothing normalizes the path: (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def test_page_and_static_files_with_csp(engine):
    async def go():
        async with serving(engine) as client:
            out = {}
            for path in ("/", "/static/app.js", "/static/style.css", "/static/favicon.svg"):
                r = await client.get(path)
                out[path] = r.status, r.headers, await r.text()
            r = await client.head("/")
            out["HEAD /"] = r.status, r.headers, ""
            return out

    out = asyncio.run(go())
    types = {"/static/app.js": "text/javascript", "/static/style.css": "text/css"}
    types["/static/favicon.svg"] = "image/svg+xml"
    for path, (status, headers, _) in out.items():
        assert status == 200, path
        assert headers["Content-Security-Policy"] == CSP == HEADERS["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Content-Type"].startswith(types.get(path, "text/html")), path
    page = out["/"][2]
    assert '<script type="module" src="/static/app.js"></script>' in page
    assert "<script>" not in page and not re.search(r"\son\w+=", page)  # no inline script
    assert "export function markdown" in out["/static/app.js"][2]


def test_static_serves_its_files_only(engine):
    probes = [
        "/static/web_ui.py",
        "/static/../web_ui.py",
        "/static/..%2Fweb_ui.py",
        "/static/%2e%2e%2fserver.py",
        "/static/..%2F..%2F..%2Fpyproject.toml",
        "/static/%2E%2E/%2E%2E/cli.py",
        "/static/",
        "/static/.",
        "/static/app.js/",
        "/static/app.js%00.py",
        "/static//etc/passwd",
        "/static/APP.JS",
    ]

    async def go():
        async with serving(engine) as client:
            return [await raw_get(client, path) for path in probes]

    for path, (status, body) in zip(probes, asyncio.run(go())):
        assert status == 404, (path, status)
        assert '"error"' in body and "import" not in body and "[project]" not in body, path


def test_page_is_refused_to_a_foreign_host(engine):
    async def go():
        async with serving(engine) as client:
            return [await raw_get(client, p, "evil.example") for p in ("/", "/static/app.js")]

    for status, body in asyncio.run(go()):
        assert status == 400 and "invalid_host" in body


def test_page_loads_without_the_api_key(engine):
    async def go():
        async with serving(engine, api_key=KEY) as client:
            return [(await client.get(p)).status for p in ("/", "/static/app.js")]

    assert asyncio.run(go()) == [200, 200]


def test_api_needs_the_key_beside_the_page(engine):
    async def go():
        async with serving(engine, api_key=KEY) as client:
            without = await client.get("/v1/models")
            with_key = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            post = await client.post("/static/app.js", headers={"Authorization": "Bearer x"})
            return without.status, with_key.status, post.status

    assert asyncio.run(go()) == (401, 200, 401)  # POST to a page route: not keyless


def test_no_web_ui_serves_no_page(engine):
    async def go():
        async with serving(engine, web_ui=False) as client:
            return [(await client.get(p)).status for p in ("/", "/static/app.js")]

    assert asyncio.run(go()) == [404, 404]


def test_ui_url():
    assert ui_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/"
    assert ui_url("0.0.0.0", 80) == "http://127.0.0.1:80/"
    assert ui_url("::", 8000) == "http://[::1]:8000/"
    assert ui_url("::1", 1) == "http://[::1]:1/"
    assert ui_url("box.example", 9) == "http://box.example:9/"


# -- in a real browser -----------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY_STORAGE = "tinyserve.key"  # app.js's sessionStorage key


def requests_by_outcome(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    found = re.findall(r'^tinyserve:requests_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', text, re.M)
    return {outcome: float(n) for outcome, n in found}


def _playwright():
    """Playwright's sync API, driving the system chromium; skips the test without them."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    return pytest.importorskip(
        "playwright.sync_api", reason="needs playwright (pip install playwright; no browsers)"
    )


def test_api_key_asked_and_kept_for_the_tab(tmp_path, smollm2_path):
    """With --api-key the page loads, asks for the key, keeps it in sessionStorage (never
    localStorage) and sends it: the model's name arrives and an answer streams."""
    playwright = _playwright()
    srv = Server(tmp_path, "--model", smollm2_path, "--api-key", KEY)
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            try:
                page = browser.new_page()
                page.goto(srv.url + "/")
                page.wait_for_selector("#key-dialog[open]")
                page.fill("#key-dialog input[name=key]", KEY)
                page.click("#key-dialog button[value=save]")
                named = "() => document.getElementById('model').textContent.length > 9"
                page.wait_for_function(named)  # /v1/models answered: the key was sent
                assert page.evaluate(f"sessionStorage.getItem('{KEY_STORAGE}')") == KEY
                stored = page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
                assert KEY not in stored
                settings(page, temperature="0", max_tokens="4", seed="1")
                page.fill("#prompt", "Hi")
                page.press("#prompt", "Enter")
                page.wait_for_selector(".assistant .stats:has-text('tokens')", timeout=60_000)
            finally:
                browser.close()
    finally:
        srv.kill()
    assert "Traceback" not in srv.log()


def test_chat_in_headless_chromium(tmp_path, smollm2_path):
    playwright = _playwright()
    srv = Server(tmp_path, "--model", smollm2_path)
    try:
        banner = [srv.proc.stdout.readline() for _ in range(2)]  # the model directory, the page
        assert f"tinyserve: chat page at {srv.url}/\n" in banner, banner
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            try:
                _drive(browser.new_page(), srv.url, tmp_path)
            finally:
                browser.close()
    finally:
        srv.kill()
    assert "Traceback" not in srv.log()


def _drive(page, url: str, tmp_path) -> None:
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.goto(url + "/")
    page.wait_for_function("() => document.getElementById('model').textContent.length > 9")
    assert page.inner_text("#model") == "SmolLM2-135M-Instruct"

    # Model output is escaped before the markdown renderer adds its own tags.
    html = page.evaluate(
        "async () => (await import('/static/app.js')).markdown("
        "'**hi** <img src=x onerror=alert(1)>\\n```\\n<script>x</script>\\n```')"
    )
    assert html.startswith("<p><strong>hi</strong> &lt;img src=x onerror=alert(1)&gt;</p>")
    assert "<pre><code>&lt;script&gt;x&lt;/script&gt;</code></pre>" in html

    settings(page, temperature="0", max_tokens="16", seed="1")
    # every text the answer showed, so the test sees it arrive in pieces
    page.evaluate("""() => { window.seen = [];
        new MutationObserver(() => { const b = document.querySelector('.assistant .body');
            if (b && b.textContent) window.seen.push(b.textContent); })
          .observe(document.getElementById('messages'), {subtree: true, childList: true}); }""")
    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".assistant .stats:has-text('tokens/s')", timeout=60_000)  # busy CPUs
    answer = page.inner_text(".assistant .body")
    stats = page.inner_text(".assistant .stats")
    seen = page.evaluate("window.seen")
    assert "Paris" in answer, answer
    assert len(set(seen)) >= 3 and all(seen[-1].startswith(s) for s in seen), seen
    assert re.search(r"tokens/s · first token \d+ ms · \d+ tokens · cached \d+/\d+ prompt", stats)

    # A long answer, stopped mid-stream: the server sees the client go away.
    settings(page, max_tokens="2000")
    page.fill("#prompt", "Write a long story about a dragon who learns to bake bread.")
    page.press("#prompt", "Enter")
    second = "document.querySelectorAll('.assistant .body')[1]"
    page.wait_for_function(f"() => {second}?.innerText.length > 20", timeout=60_000)  # words in
    page.click("#stop")
    page.wait_for_selector(".assistant .stats:has-text('stopped')")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    stopped = page.inner_text(".assistant >> nth=1")
    deadline = time.monotonic() + 10
    while requests_by_outcome(url).get("aborted", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    outcomes = {"ok": 1, "aborted": 1, "timeout": 0, "rejected": 0, "error": 0}
    assert requests_by_outcome(url) == outcomes

    page.reload()
    page.wait_for_selector(".message.assistant >> nth=1")
    users = page.locator(".message.user").all_inner_texts()
    assert users == [
        "What is the capital of France?",
        "Write a long story about a dragon who learns to bake bread.",
    ]
    assert page.inner_text(".assistant .body") == answer
    assert page.inner_text(".assistant >> nth=1") == stopped
    assert page.locator("#chats li").count() == 1
    shot = tmp_path / "web_ui.png"
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")

    page.click("#new-chat")
    assert page.locator(".message").count() == 0 and page.locator("#chats li").count() == 2
    assert errors == [], errors


def settings(page, **fields: str) -> None:
    page.click("#open-settings")
    for name, value in fields.items():
        page.fill(f"#settings [name={name}]", value)
    page.click("#settings button[value=save]")
