"""The demo page of `mkport serve` at `/` (mkport/serve/static/): served, self-contained (same-origin URLs
only, so it works offline), fed by /v1/models; and, in a real headless Chromium driven by Selenium, a request
from the page streams audio and fills in the time to first audio and the real-time factor. The browser test
skips where Selenium, Chromium or chromedriver is missing (.ci/run installs them where apt works).
MKPORT_DEMO_SCREENSHOT=FILE.png saves the page after the request (docs/img/demo-page.png is made so)."""

from __future__ import annotations

import json
import os
import re
import shutil

import httpx
import pytest

from test_serve import FRAMES, SPF, Server, speech, tts_cache  # noqa: F401  (tts_cache: a fixture)

from mkport.serve.app import STATIC

TEXT = "Hello from the demo page."


@pytest.fixture(scope="module")
def server(tts_cache, tmp_path_factory):  # noqa: F811
    s = Server(tts_cache, tmp_path_factory.mktemp("serve_demo") / "server.log", "--max-streams", "2",
               "--max-frames", "400")
    yield s
    s.stop()


def page_urls(text: str) -> list[str]:
    """The URLs a page or script refers to: src/href attributes and fetch() calls."""
    return re.findall(r'(?:src|href)="([^"]*)"', text) + re.findall(r'fetch\(\s*"([^"]*)"', text)


def test_page_is_served_and_self_contained(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for element in ("play", "stop", "ttfa", "rtf", "stalls", "notice"):
        assert f'id="{element}"' in r.text, element
    assert "ran dry" not in r.text and "playback caught up with generation" in r.text
    files = {"/": r.text}
    for url in page_urls(r.text):
        if url.startswith("/static/"):
            asset = httpx.get(server.url + url)
            assert asset.status_code == 200, url
            files[url] = asset.text
    assert set(files) == {"/", "/static/demo.js", "/static/demo.css"}
    for name, text in files.items():
        assert not re.search(r"https?://|//[a-z0-9]", text, re.I), f"{name} refers to another host"
        for url in page_urls(text):  # same origin: an absolute path, or an inline data: URL
            assert (url.startswith("/") and not url.startswith("//")) or url.startswith("data:"), (name, url)
    assert {"/v1/models", "/v1/audio/speech"} <= set(page_urls(files["/static/demo.js"]))
    # what the package ships is what is served
    assert (STATIC / "demo.js").read_text() == files["/static/demo.js"]


def test_models_lists_the_voices_and_languages_of_the_model(server, tts_cache):  # noqa: F811
    talker = json.loads((tts_cache / "tts-random" / "tiny-0" / "config.json").read_text())["talker_config"]
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert sorted(model["voices"]) == sorted(v.lower() for v in talker["spk_id"]) and model["voices"]
    assert model["default_voice"] in model["voices"]
    assert sorted(model["languages"]) == sorted(["auto"] + [k.lower() for k in talker["codec_language_id"]])


# -- a real browser ----------------------------------------------------------------------------------------
def browser():
    """A headless Chromium under Selenium, or a skip naming what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[browser]')")
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,660",
                "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))


def test_page_streams_and_times_a_request_in_a_browser(server):
    chrome = browser()  # first: it skips, naming what is missing, where selenium or a browser is absent
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    try:
        chrome.get(server.url + "/")
        WebDriverWait(chrome, 30).until(lambda d: d.find_element(By.ID, "play").is_enabled())
        notice = chrome.find_element(By.ID, "notice")  # the tiny model's weights are random
        assert notice.is_displayed() and "random weights" in notice.text
        assert not chrome.find_element(By.ID, "stop").is_enabled()
        voices = [o.get_attribute("value") for o in Select(chrome.find_element(By.ID, "voice")).options]
        assert voices == httpx.get(server.url + "/v1/models").json()["data"][0]["voices"]
        voice = voices[-1]
        Select(chrome.find_element(By.ID, "voice")).select_by_value(voice)
        text_box = chrome.find_element(By.ID, "text")
        text_box.clear()
        text_box.send_keys(TEXT)
        chrome.find_element(By.ID, "max-frames").send_keys(str(FRAMES))
        chrome.find_element(By.ID, "play").click()
        WebDriverWait(chrome, 120).until(lambda d: d.find_element(By.ID, "status").text.startswith(("done", "4", "5"))
                                         or "error" in d.find_element(By.ID, "status").get_attribute("class"))
        status = chrome.find_element(By.ID, "status")
        assert status.get_attribute("class") != "error", status.text

        ttfa = float(re.fullmatch(r"(\d+) ms", chrome.find_element(By.ID, "ttfa").text).group(1))
        rtf = float(chrome.find_element(By.ID, "rtf").text)
        received = int(chrome.find_element(By.ID, "bytes").text)
        assert ttfa > 0 and rtf > 0
        assert 0 < received <= FRAMES * SPF * 2 and received % (SPF * 2) == 0
        # the page asked for what the form said: the same request over plain HTTP gives the same audio length
        direct = speech(server.url, input=TEXT, voice=voice, response_format="pcm", seed=0)
        assert direct.status_code == 200 and len(direct.content) == received
        row = [c.text for c in chrome.find_elements(By.CSS_SELECTOR, "#history tbody tr:first-child td")]
        assert row[:2] == [TEXT, voice] and float(row[3]) == rtf
        assert float(row[4]) == pytest.approx(received / 2 / 24000, abs=0.01)
        severe = [e["message"] for e in chrome.get_log("browser") if e["level"] == "SEVERE"]
        assert severe == []
        if os.environ.get("MKPORT_DEMO_SCREENSHOT"):
            chrome.save_screenshot(os.environ["MKPORT_DEMO_SCREENSHOT"])
    finally:
        chrome.quit()


def test_stop_ends_playback_and_cancels_the_request(server):
    """Stop, while a long request streams (400 frames, ~20 s on CPU): the page says it stopped, and the server
    counts the stream cancelled and frees its slot."""
    chrome = browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        cancelled = server.metric('mkport_streams_total{outcome="cancelled"}')
        chrome.get(server.url + "/")
        WebDriverWait(chrome, 30).until(lambda d: d.find_element(By.ID, "play").is_enabled())
        chrome.find_element(By.ID, "max-frames").send_keys("400")
        chrome.find_element(By.ID, "play").click()
        WebDriverWait(chrome, 60).until(lambda d: int(d.find_element(By.ID, "bytes").text) > 0)
        assert server.metric("mkport_active_streams") == 1
        chrome.find_element(By.ID, "stop").click()
        WebDriverWait(chrome, 10).until(lambda d: d.find_element(By.ID, "status").text.startswith("stopped"))
        received = int(chrome.find_element(By.ID, "bytes").text)
        assert 0 < received < 400 * SPF * 2  # cut short
        assert not chrome.find_element(By.ID, "stop").is_enabled() and chrome.find_element(By.ID, "play").is_enabled()
        WebDriverWait(chrome, 10).until(lambda d: server.metric("mkport_active_streams") == 0)
        assert server.metric('mkport_streams_total{outcome="cancelled"}') == cancelled + 1
        assert chrome.find_elements(By.CSS_SELECTOR, "#history tbody tr") == []  # a stopped request is no result
    finally:
        chrome.quit()
