"""/docs renders the request fields in a real headless browser, with no CDN to reach.

The screenshot goes to the test's temporary directory, so a test run never changes the
checkout; ``docs/openapi-docs.png`` is one such screenshot, copied there by hand. Needs
Debian's ``chromium``; skipped where it is not installed.
"""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from conftest import make_llm
from server_harness import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=15000", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_docs_page_shows_the_request_fields(model_dir, tmp_path):
    engine = make_llm(model_dir("llama")).llm_engine
    with running_server(engine, served_model_name=["tiny"]) as (url, _):
        page = httpx.get(url + "/docs").text
        assert "cdn" not in page.lower()  # Swagger UI comes from the server itself
        # the completions operation expanded, with its request body schema showing
        target = url + "/docs#/default/completions_v1_completions_post"
        dom = _chromium("--dump-dom", target).stdout
        assert "/v1/completions" in dom and "CompletionRequest" in dom, dom[-2000:]
        for field in ("top_k", "logit_bias", "stop_token_ids", "repetition_penalty"):
            assert field in dom, field
        shot = tmp_path / "openapi-docs.png"
        _chromium(f"--screenshot={shot}", "--window-size=1280,2400", target)
        assert shot.stat().st_size > 20_000
