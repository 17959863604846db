"""The example web app (examples/webapp/app.py) in a real headless browser: it starts `kvrag serve` on
the real default model; the test adds a document, asks, reads the answer as it streams into the page,
and checks the passages and the reuse readout in block, full and blend mode, and the server's shadow checks.

Needs Chromium and its driver (Debian: `apt-get install chromium chromium-driver`, which ./run's set-up
does where it can); without them the test fails, it does not skip. KVRAG_SCREENSHOT=PATH saves the
page at the end (docs/images/webapp.png in the README)."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

APP = Path(__file__).resolve().parents[1] / "examples" / "webapp" / "app.py"
DOCUMENT = """The Varnholm lighthouse was built in 1873 by the engineer Ilsa Brandt. It stands on the northern cliff.

Orrin Vale is a painter from the town of Selby Cross. His best known work is a mural called The Tin Harvest.

The river Olm freezes every winter. Fishermen of Kettering Bay cross it on foot in January."""
QUESTION, ANSWER = "Who built the Varnholm lighthouse?", "brandt"
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _browser_paths() -> tuple[str, str]:
    chromium = os.environ.get("KVRAG_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("KVRAG_CHROMEDRIVER") or shutil.which("chromedriver")
    if missing := [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path]:
        pytest.fail(f"the web app's browser test needs Chromium and chromedriver, and {' and '.join(missing)} "
                    "is not on PATH: install them with "
                    "`sudo apt-get install chromium chromium-driver` (Debian/Ubuntu; ./run's set-up does this when "
                    "it runs as root), or name them with KVRAG_CHROMIUM and KVRAG_CHROMEDRIVER", pytrace=False)
    return chromium, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*BROWSER_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def webapp(kvrag_home, tmp_path_factory):
    """The app as its README command starts it (it starts `kvrag serve` itself); its URL once the page answers."""
    port, log_path = _free_port(), tmp_path_factory.mktemp("webapp") / "webapp.log"
    env = {**os.environ, "KVRAG_HOME": str(kvrag_home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        app = subprocess.Popen([sys.executable, str(APP), "--port", str(port), "--shadow", "1"], stdout=log,
                               stderr=subprocess.STDOUT, env=env)  # every reused answer checked against full
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert app.poll() is None, f"the web app exited ({app.returncode}):\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the web app did not start:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url
    finally:
        app.send_signal(signal.SIGTERM)
        try:
            app.wait(60)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
    server_port = re.search(r"serve on port (\d+)", log_path.read_text())
    assert app.returncode == 143 and server_port, log_path.read_text()[-3000:]
    with socket.socket() as s:  # the app stopped the server it started
        assert s.connect_ex(("127.0.0.1", int(server_port[1]))) != 0, "kvrag serve still runs after the app stopped"


def _ask(browser, question: str, mode: str, timeout: float = 300) -> tuple[list[str], dict]:
    """Ask in the page; every text the answer box showed while streaming, and the readout at the end."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.wait import WebDriverWait

    Select(browser.find_element(By.ID, "mode")).select_by_value(mode)
    box = browser.find_element(By.ID, "question")
    box.clear()
    box.send_keys(question)
    browser.execute_script(  # records the answer box's text after every change, before the page reads it whole
        "window.seen = []; new MutationObserver((records) => records.forEach((r) => r.addedNodes.forEach("
        "(n) => window.seen.push(n.textContent)))).observe(document.getElementById('answer'), {childList: true});")
    browser.find_element(By.ID, "ask").click()
    WebDriverWait(browser, timeout).until(
        lambda b: b.find_element(By.ID, "answer").get_attribute("data-state") in ("done", "error"))
    assert browser.find_element(By.ID, "answer").get_attribute("data-state") == "done", \
        browser.find_element(By.ID, "status").text
    readout = {name: browser.find_element(By.ID, name).text
               for name in ("ttft", "reused", "prompt-tokens", "prefilled", "readout-mode", "shadow")}
    return browser.execute_script("return window.seen"), readout


def test_add_a_document_ask_and_read_the_streamed_answer_in_each_mode(browser, webapp):  # no browser: fails at once
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    browser.get(webapp)
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "count").get_attribute("data-passages") == "0")
    browser.find_element(By.ID, "documents").send_keys(DOCUMENT)
    browser.find_element(By.ID, "add").click()
    WebDriverWait(browser, 120).until(lambda b: b.find_element(By.ID, "count").get_attribute("data-passages") not in ("0", None))
    assert "Added" in browser.find_element(By.ID, "status").text

    for mode in ("block", "full", "blend", "block"):  # block twice: a warm request's readout ends the page
        seen, readout = _ask(browser, QUESTION, mode)
        answer = browser.find_element(By.ID, "answer").text
        passages = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#passages li")]
        # streamed: the answer box grew delta by delta, each text a prefix of the next
        assert len(seen) >= 3 and " ".join(seen[-1].split()) == " ".join(answer.split()), seen
        assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), seen
        assert ANSWER in answer.lower(), (mode, answer)
        assert any("Varnholm lighthouse was built in 1873" in p for p in passages), passages
        assert readout["readout-mode"] == mode and float(readout["ttft"]) > 0, readout
        reused, prompt, prefilled = (int(readout[k]) for k in ("reused", "prompt-tokens", "prefilled"))
        assert prompt > 0 and (reused == 0 if mode == "full" else reused > 0), (mode, readout)
        if mode != "blend":  # blend recomputes some of the tokens it reuses
            assert reused + prefilled == prompt, (mode, readout)
    # the shadow checks of the earlier block and blend answers, made while the page was idle, in the last readout
    assert re.search(r"shadow checks, the same as full: .*block \d+ of [1-9]", readout["shadow"]), readout
    history = browser.find_elements(By.CSS_SELECTOR, "#history tr")
    assert [row.find_element(By.TAG_NAME, "td").text for row in history] == ["block", "blend", "full", "block"]
    browser.find_element(By.ID, "sample").click()  # the package's sample corpus, its questions offered
    WebDriverWait(browser, 300).until(lambda b: b.find_element(By.ID, "status").text.startswith(("Added", "Could not")))
    assert int(browser.find_element(By.ID, "count").get_attribute("data-passages")) > 3, \
        browser.find_element(By.ID, "status").text
    assert browser.find_elements(By.CSS_SELECTOR, "#sample-questions option")
    if path := os.environ.get("KVRAG_SCREENSHOT"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        height = browser.execute_script("return Math.ceil(document.body.getBoundingClientRect().bottom)")
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",  # the viewport: the whole page
                                {"width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False})
        assert browser.save_screenshot(path)
