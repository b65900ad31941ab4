"""compare's report.html and the drift report opened in a real headless Chromium (Playwright), as a reader opens them.

The DOM-parser tests (test_compare_cli.py, test_drift.py) see the elements; these see what the page shows: it renders
without a console error, a page error or a request for anything outside the file, the verdict and the first
differing sample (or jump) are visible, the inline images decode, and the report's one script (the cause filter)
works. Each test keeps a full-page screenshot in its tmp folder.

The browser: `chromium` on the PATH (Debian's package; `make setup` installs it when run as root), else Playwright's
own download (`playwright install chromium`); with neither, the tests skip and say so, or fail where
VLMRL_REQUIRE_BROWSER=1 (CI sets it: there a missing browser is a broken setup, not a reason to skip).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.alignment.test_drift import quiet_then, record, write_run
from tests.alignment.toy_artifacts import write_side
from vlmrl.alignment import compare, drift

pytestmark = pytest.mark.browser

INSTALL = ("no Chromium for the browser tests: `sudo apt-get install chromium` (Debian; `make setup` run as root does "
           "it), or Playwright's own download: `.venv/bin/python -m playwright install chromium`")
PNG = b"\x89PNG\r\n\x1a\n"


def _missing(reason: str):
    if os.environ.get("VLMRL_REQUIRE_BROWSER") == "1":
        pytest.fail(f"VLMRL_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (run `make setup`)")
    with sync_playwright() as playwright:
        path = shutil.which("chromium") or shutil.which("chromium-browser")
        if path is None and not Path(playwright.chromium.executable_path).exists():
            _missing(INSTALL)
        browser = playwright.chromium.launch(executable_path=path)  # None: Playwright's own download
        yield browser
        browser.close()


@pytest.fixture
def reader(browser):
    """A fresh page, and the list of what its console shows (errors, warnings, uncaught exceptions) and of any request
    that leaves the file: a report is one file read offline."""
    page, problems = browser.new_page(viewport={"width": 1280, "height": 900}), []
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(f"console {m.type}: {m.text}"))
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("request", lambda r: r.url.startswith(("file:", "data:"))
            or problems.append(f"request outside the report: {r.url}"))
    yield page, problems
    page.close()


def _open(page, path: Path) -> None:
    page.goto(path.as_uri(), wait_until="load")
    broken = page.eval_on_selector_all("img", "imgs => imgs.filter(i => !i.complete || i.naturalWidth === 0)"
                                              ".map(i => i.alt)")
    assert broken == [], f"images that did not decode: {broken}"


def _screenshot(page, path: Path) -> Path:
    """The whole page as a reader sees it, kept in the test's tmp folder (taken first, so a failing test keeps it)."""
    page.screenshot(path=path, full_page=True)
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000, f"{path}: {len(data)} bytes"
    return path


def test_compare_report_shows_the_verdict_and_the_first_differing_sample(tmp_path, reader):
    """One row flips a near-tie and B's shorter budget cuts two responses: NOT ALIGNED, the near-tie card first with
    the divergence highlighted; the cause filter shows one cause at a time; the exact samples stay folded."""
    page, problems = reader
    a = write_side(tmp_path / "a.jsonl", rows=6)
    b = write_side(tmp_path / "b.jsonl", rows=6, backend="sglang", flip_rows=frozenset({2}), max_new_tokens=8)
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "out")]) == 1
    _open(page, tmp_path / "out" / "report.html")
    _screenshot(page, tmp_path / "report.png")

    verdict = page.locator("header .verdict")
    assert verdict.is_visible() and verdict.inner_text() == "NOT ALIGNED"
    first = page.locator(".card.diff").first
    assert first.is_visible() and first.get_attribute("id") == "row2-0"
    assert first.locator(".badge").inner_text() == "numerical near-tie" and first.locator("mark").first.is_visible()
    assert page.locator(".card:not(.diff)").first.is_hidden(), "exact samples start folded"

    page.get_by_role("button", name="length / finish reason only (2)").click()
    assert first.is_hidden() and page.locator(".card.diff:visible").count() == 2
    page.get_by_role("button", name="all differing").click()
    assert page.locator(".card.diff:visible").count() == 3
    page.get_by_text("Exact samples (3)").click()
    assert page.locator(".card:not(.diff):visible").count() == 3
    assert problems == []


def test_drift_report_shows_the_verdict_and_the_jump(tmp_path, reader):
    """Step 6 sampled with step 4's weights: the verdict names the jump, the plot shows, and the jump's worst sample
    reads whole with its cause."""
    page, problems = reader
    run = write_run(tmp_path / "run", quiet_then([record(6, 0.3, engine_version=4)]))
    assert drift.main([str(run), "--out", str(tmp_path / "report")]) == 1
    _open(page, tmp_path / "report" / "drift.html")
    _screenshot(page, tmp_path / "drift.png")

    verdict = page.locator("#verdict")
    assert verdict.is_visible() and verdict.inner_text() == "1 jump(s): step 6"
    assert page.locator("#plot").is_visible()
    worst = page.locator("#jump-6 tr.worst").first
    assert worst.is_visible() and worst.locator("td.cause").get_attribute("data-cause") == "weights"
    lines = worst.locator("td").first.evaluate("td => { const r = document.createRange(); r.selectNodeContents(td);"
                                                " return r.getClientRects().length; }")
    assert lines == 1, "the uid is shown whole, not broken at its hyphen beside the long explanations"
    assert page.locator("#steps tr.jump").is_visible()
    assert problems == []
