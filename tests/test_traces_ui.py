"""The trace UI seen in a real browser: ``dflash up --traces-ui`` starts Phoenix beside the
services, one request's trace (gateway -> verifier -> drafter spans under one trace id) reaches
it, and headless Chromium finds that trace and its tau in the UI, then saves a screenshot.

Opt-in (DFLASH_TEST_BROWSER=1, marker ``browser``; .ci/run sets it): it needs Phoenix in
.venv-traces and Debian's chromium + chromium-driver, which ``scripts/setup_traces.sh
--browser`` installs; without them it skips saying which is missing. DFLASH_SCREENSHOT_DIR:
also write the screenshot there (docs/img/traces-ui.png was made this way).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from dflash.client import build_request
from dflash.serving.server import wait_healthy
from dflash.v1 import gateway_pb2_grpc
from dflash_app.traces_ui import PROJECT, find_phoenix

from helpers import free_ports, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _missing() -> str | None:
    if os.environ.get("DFLASH_TEST_BROWSER") != "1":
        return ("opt-in: set DFLASH_TEST_BROWSER=1 (starts Phoenix and headless Chromium; "
                "scripts/setup_traces.sh --browser installs both)")
    if find_phoenix() is None:
        return "Arize Phoenix is not installed: run scripts/setup_traces.sh"
    if not (CHROMIUM and CHROMEDRIVER):
        return ("headless Chromium is missing (chromium and chromedriver on PATH): "
                "apt-get install chromium chromium-driver, or scripts/setup_traces.sh --browser")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (dev extra: scripts/setup.sh)"
    return None


MISSING = _missing()
pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]


def _get_json(url: str):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as r:
        return json.load(r)


def _trace_spans(ui: str, trace_id: str) -> list[dict]:
    try:
        return _get_json(f"{ui}/v1/projects/{PROJECT}/spans?trace_id={trace_id}&limit=1000")["data"]
    except (OSError, KeyError):
        return []


def _complete(spans: list[dict]) -> bool:
    names = {s["name"] for s in spans}
    return {"/dflash.v1.Verifier/Generate", "verifier.decode", "drafter.draft"} <= names and any(
        s["attributes"].get("gen_ai.operation.name") for s in spans)


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        opts.add_argument(a)
    # the driver from PATH: Selenium Manager would try to download one
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.fixture
def stack_with_ui(tmp_path, tiny_target, make_drafter):
    """``dflash up --traces-ui`` on free ports; yields (gateway address, UI URL, up's output)."""
    gw, ver, dr, ui, otlp = free_ports(5)
    up = subprocess.Popen(
        [sys.executable, "-m", "dflash_app.cli", "up", "--target", str(tiny_target),
         "--drafter", str(make_drafter(block_size=8)), "--gateway-port", str(gw),
         "--verifier-port", str(ver), "--drafter-port", str(dr), "--http-port", "0",
         "--traces-ui", "--traces-ui-port", str(ui), "--traces-ui-otlp-port", str(otlp),
         "--run-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed: list[str] = []
    try:
        assert wait_healthy(f"127.0.0.1:{gw}", 300), up.stdout.read() if up.poll() is not None else "timeout"
        while not printed or not printed[-1].startswith("logs in"):   # the summary `up` prints
            line = up.stdout.readline()
            assert line, "".join(printed)
            printed.append(line)
        yield f"127.0.0.1:{gw}", f"http://127.0.0.1:{ui}", "".join(printed)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0
    with pytest.raises(urllib.error.URLError):   # Phoenix stopped with the stack
        _get_json(f"http://127.0.0.1:{ui}/healthz")


def test_one_request_trace_and_its_tau_in_the_ui(stack_with_ui, tmp_path):
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    gateway, ui, printed = stack_with_ui
    assert f"traces UI {ui}" in printed, printed
    trace_id = secrets.token_hex(16)
    md = (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),)   # the client's trace
    with grpc.insecure_channel(gateway) as ch:
        out = list(gateway_pb2_grpc.GatewayStub(ch).Generate(
            build_request("Hello", max_tokens=24), metadata=md, timeout=120))
    tau = out[-1].acceptance.mean_acceptance_length
    done = time.monotonic()

    # The trace's spans reach Phoenix: all three services, linked, under the client's trace id.
    got: dict[str, list[dict]] = {"spans": []}

    def arrived() -> bool:
        got["spans"] = _trace_spans(ui, trace_id)
        return _complete(got["spans"])

    wait_until(arrived, 30, lambda: f"the trace in Phoenix (spans: {sorted({s['name'] for s in got['spans']})})")
    seen_s = time.monotonic() - done
    spans = got["spans"]
    by_id = {s["context"]["span_id"]: s for s in spans}
    (gw,) = [s for s in spans if s["attributes"].get("gen_ai.operation.name")]
    (ver,) = [s for s in spans if s["name"] == "/dflash.v1.Verifier/Generate"]
    assert {s["context"]["trace_id"] for s in spans} == {trace_id}
    (gw_rpc,) = [s for s in spans if s["name"] == "/dflash.v1.Gateway/Generate"]
    assert gw_rpc["parent_id"] == md[0][1].split("-")[2]      # the client's span
    assert gw["parent_id"] == gw_rpc["context"]["span_id"]
    assert ver["parent_id"] == gw["context"]["span_id"]
    drafts = [s for s in spans if s["name"] == "drafter.draft"]
    assert drafts and all(by_id[d["parent_id"]]["name"] == "verifier.step" for d in drafts)
    assert gw["attributes"]["dflash.mean_acceptance_length"] == pytest.approx(tau)
    assert seen_s < 15, f"the trace took {seen_s:.1f} s to reach the UI"

    # The same trace in a real browser: its span tree, then the gateway span's tau.
    driver = _browser()
    try:
        driver.get(f"{ui}/redirects/traces/{trace_id}")
        body = lambda: driver.find_element(By.TAG_NAME, "body").text  # noqa: E731
        WebDriverWait(driver, 60).until(lambda d: all(
            n in body() for n in (gw["name"], "/dflash.v1.Verifier/Generate", "drafter.draft")))
        assert trace_id in body()
        # the tree opens on the root (the gateway's RPC span): select the GenAI span
        # (its name is also in the traces table under the trace's panel: click what takes it)
        for el in driver.find_elements(By.XPATH, f"//*[normalize-space(text())='{gw['name']}']"):
            try:
                el.click()
                break
            except WebDriverException:
                continue
        tab = WebDriverWait(driver, 30).until(lambda d: next(
            (t for t in d.find_elements(By.CSS_SELECTOR, "[role=tab]")
             if t.text.strip() == "Attributes"), None))
        tab.click()
        key = WebDriverWait(driver, 30).until(lambda d: next(
            (e for e in d.find_elements(By.XPATH, "//tr[td[normalize-space()="
                                        "'dflash.mean_acceptance_length']]")), None))
        shown = key.find_elements(By.TAG_NAME, "td")[1].text
        assert float(shown) == pytest.approx(tau)
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", key)
        shot = tmp_path / "traces-ui.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if os.environ.get("DFLASH_SCREENSHOT_DIR"):
            shutil.copy(shot, os.path.join(os.environ["DFLASH_SCREENSHOT_DIR"], shot.name))
    finally:
        driver.quit()
