"""The chat page (``minipaged/server/ui.py``) in a real browser: Debian's Chromium,
driven by Playwright over its DevTools protocol (Playwright's own browser
download is never used: it would need the network).

The server runs in this process (``BackgroundServer``) with an API key, over
the tiny random LLaMA with the one-character-per-token tokenizer, so every
token is one character and every step one server-sent event. The page is
used as a person would: the key typed in, a system prompt, a question sent
with Enter. The streamed answer must grow over several updates of the page
and end equal to the offline ``LLM``'s greedy answer to the same
conversation; a long answer is stopped, and the server must abort it: the
running gauge and the KV blocks in use return to 0 with fewer tokens
generated than the answer was allowed.

No step can hang: every browser action and wait has a timeout (the page's
default, ``STEP_TIMEOUT_MS``), every HTTP call has one, and every poll a
deadline. Chromium and Playwright are not on every machine: the tests skip
without them, except under CI (``CI`` set), which installs both
(``.ci/run``), and where they fail instead.
"""

import json
import os
import shutil
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import SERVER_CHAT_TEMPLATE, SERVER_MESSAGES, SERVER_MODEL, server_engine_kwargs
from minipaged import SamplingParams
from minipaged.engine import LLMEngine
from minipaged.server import BackgroundServer, build_app
from minipaged.server.cli import parse_args

CHROMIUM = "/usr/bin/chromium"
# Headless, and nothing that reaches for the network on its own (updates,
# sync, QUIC probes): the machine has none, and the test talks to loopback only.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
API_KEY = "page-test-key"
STEP_TIMEOUT_MS = 10_000   # any one browser action or wait
HTTP_TIMEOUT_S = 10
# The model's whole context (the tiny model's max_position_embeddings), so that
# a long answer can be a few hundred tokens.
MAX_MODEL_LEN = 512
# The tiny model decodes a few hundred tokens a second on 2 cores, so a long
# answer could be over in about a second; a pause after each engine step makes
# it last at least LONG_ANSWER_TOKENS * STEP_PAUSE_S (1.8 s) on any machine,
# ample time to see it running and press stop.
STEP_PAUSE_S = 0.005
SHORT_ANSWER_TOKENS = 24
LONG_ANSWER_TOKENS = 360   # with the conversation's ~120 tokens, within MAX_MODEL_LEN


def unavailable(message: str):
    """Skip, or under CI (which installs the browser) fail."""
    if os.environ.get("CI"):
        pytest.fail(message + "; .ci/run installs it")
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser():
    """Chromium, headless, through Playwright's synchronous API."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("Playwright is not installed (pip install playwright)")
    if shutil.which(CHROMIUM) is None:
        unavailable(f"Chromium is not installed at {CHROMIUM} "
                    "(apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                    timeout=30_000)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(model_dir):
    """The server with an API key, its engine paced by ``STEP_PAUSE_S`` a step."""
    engine = LLMEngine(str(model_dir), **{**server_engine_kwargs(),
                                          "max_model_len": MAX_MODEL_LEN})
    engine.tokenizer.chat_template = SERVER_CHAT_TEMPLATE
    engine.step_hooks.append(lambda *_: time.sleep(STEP_PAUSE_S))
    srv = BackgroundServer(build_app(engine, SERVER_MODEL, api_key=API_KEY),
                           timeout_s=HTTP_TIMEOUT_S)
    yield srv
    srv.stop()


@pytest.fixture
def page(browser, server):
    """A fresh page on /chat; JavaScript errors fail the test."""
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    page.set_default_timeout(STEP_TIMEOUT_MS)
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.url + "/chat")
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def expect(locator):
    """Playwright's auto-waiting assertions (``STEP_TIMEOUT_MS`` at most). Its
    own ``wait_for_function`` is not used: it evaluates its predicate with
    eval, which the page's Content-Security-Policy forbids."""
    from playwright.sync_api import expect as playwright_expect

    playwright_expect.set_options(timeout=STEP_TIMEOUT_MS)
    return playwright_expect(locator)


# True once the newest answer has 5 characters, or the page shows an error.
STREAMING_OR_FAILED = """() =>
  document.querySelector(".turn.assistant:last-child .content").textContent.length >= 5
  || !document.getElementById("error").hidden"""


def enter_key(page) -> None:
    """Type the API key in (the page rereads the model when the field changes)."""
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Tab")   # `change` fires when the field loses focus
    expect(page.locator("#model")).to_have_text(SERVER_MODEL)


def set_fields(page, *, system="", temperature="0", max_tokens="", extra="") -> None:
    page.fill("#system", system)
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    if page.get_attribute("details", "open") is None:
        page.click("details summary")   # the advanced fields are folded away
    page.fill("#extra", extra)


def sample(url: str, name: str, **labels: str) -> float:
    """One sample's value in a scrape of /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=HTTP_TIMEOUT_S).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def running(url: str) -> float:
    return sample(url, "minipaged_num_requests_running")


def generated(url: str) -> float:
    return sample(url, "minipaged_generation_tokens_total")


def poll(check, what: str, timeout_s: float = 10.0, every_s: float = 0.02):
    """``check()``'s first true value within ``timeout_s``, else a failure naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(every_s)


# Records the length of the newest answer's text each time the page's changes
# to it are reported: once per batch of changes that JavaScript made in one go,
# so a list of several lengths means the reader saw the text grow.
WATCH_ANSWERS = """() => {
  window.answerLengths = [];
  new MutationObserver((records) => {
    const answers = document.querySelectorAll(".turn.assistant .content");
    const newest = answers[answers.length - 1];
    if (newest && records.some((r) => r.type === "characterData")) {
      window.answerLengths.push(newest.textContent.length);
    }
  }).observe(document.getElementById("transcript"),
             {subtree: true, childList: true, characterData: true});
}"""


def last_answer(page):
    return page.locator(".turn.assistant").last


# -- without a browser: the routes ----------------------------------------------------------

def test_the_page_and_its_files_are_served(server):
    for path in ("/", "/chat"):
        r = httpx.get(server.url + path, timeout=HTTP_TIMEOUT_S)   # no key: the page is open
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert '<script src="ui/chat.js"' in r.text
    js = httpx.get(server.url + "/ui/chat.js", timeout=HTTP_TIMEOUT_S)
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert "getReader" in js.text and "innerHTML" not in js.text
    assert httpx.get(server.url + "/ui/chat.css", timeout=HTTP_TIMEOUT_S).status_code == 200
    # Only the page's own files: no other name, no path out of the folder.
    for name in ("index.html", "ui.py", "..%2Fui.py", "missing.js"):
        assert httpx.get(server.url + "/ui/" + name, timeout=HTTP_TIMEOUT_S).status_code == 404
    # The page is not part of the API's schema.
    paths = httpx.get(server.url + "/openapi.json", timeout=HTTP_TIMEOUT_S).json()["paths"]
    assert "/" not in paths and "/chat" not in paths


def test_disable_ui_leaves_the_page_out(model_dir):
    from fastapi.testclient import TestClient

    assert parse_args(["--disable-ui"]).disable_ui and not parse_args([]).disable_ui
    engine = LLMEngine(str(model_dir), **server_engine_kwargs())
    for ui, page_status in ((True, 200), (False, 404)):
        app = build_app(engine, SERVER_MODEL, ui=ui)
        # Not entered as a context manager: the app's lifespan (the engine loop) never runs.
        client = TestClient(app)
        try:
            for path in ("/", "/chat", "/ui/chat.js"):
                assert client.get(path).status_code == page_status, (ui, path)
            assert client.get("/v1/models").status_code == 200   # the API either way
        finally:
            client.close()
            app.state.metrics.close()   # its step hook off the engine


# -- in the browser ---------------------------------------------------------------------------

def test_the_page_shows_the_servers_errors(page, server):
    # Before the key is typed in, /v1/models refuses the page: no Authorization was sent.
    page.wait_for_selector("#error:not([hidden])")
    assert "invalid or missing API key" in page.text_content("#error")
    assert page.text_content("#model") == "unknown"
    enter_key(page)
    assert page.is_hidden("#error")

    # Extra fields that are not JSON never reach the server.
    set_fields(page, extra="{not json")
    page.fill("#prompt", "Hi!")
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error").startswith("Extra request fields:")

    # A value the server refuses: the page shows the error body's message.
    bad = {"top_p": 5}
    page.fill("#extra", json.dumps(bad))
    page.click("#send")
    expect(page.locator("#error")).to_contain_text("top_p")
    refused = httpx.post(server.url + "/v1/chat/completions", timeout=HTTP_TIMEOUT_S,
                         headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": SERVER_MODEL, "messages": SERVER_MESSAGES[1:],
                               "stream": True, **bad})
    assert refused.status_code == 400
    assert page.text_content("#error") == refused.json()["error"]["message"]
    # The failed turn is gone and the question is back in the box, to send again.
    assert page.locator(".turn").count() == 0
    assert page.input_value("#prompt") == "Hi!"
    assert page.is_enabled("#send") and page.is_disabled("#stop")


def test_an_answer_streams_in_and_stop_aborts_the_next(page, server, llm):
    enter_key(page)
    system, question = SERVER_MESSAGES[0]["content"], SERVER_MESSAGES[1]["content"]
    set_fields(page, system=system, max_tokens=str(SHORT_ANSWER_TOKENS),
               extra='{"ignore_eos": true}')
    page.evaluate(WATCH_ANSWERS)

    # -- a short greedy answer, streamed -------------------------------------------------
    page.fill("#prompt", question)
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    request = sent.value
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    body = request.post_data_json
    assert body["messages"] == SERVER_MESSAGES
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == SHORT_ANSWER_TOKENS
    assert body["ignore_eos"] is True and body["model"] == SERVER_MODEL

    answer = last_answer(page)
    answer.and_(page.locator("[data-state=done]")).wait_for()
    text = answer.locator(".content").text_content()
    reference = llm.chat(SERVER_MESSAGES, SamplingParams(
        temperature=0.0, max_tokens=SHORT_ANSWER_TOKENS, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    assert text == reference
    lengths = page.evaluate("window.answerLengths")
    assert lengths == sorted(lengths) and lengths[-1] == len(text), lengths
    assert len(set(lengths)) > 1, f"the answer appeared in one piece: {lengths}"
    # The stats line: from the usage chunk (no "(counted)"), time to first token, rate.
    assert answer.get_attribute("data-tokens") == str(SHORT_ANSWER_TOKENS)
    assert float(answer.get_attribute("data-ttft-ms")) > 0
    assert float(answer.get_attribute("data-tokens-per-s")) > 0
    stats = answer.locator(".stats").text_content()
    assert f"{SHORT_ANSWER_TOKENS} tokens ·" in stats and "finish: length" in stats

    # -- a long answer, stopped while it streams -------------------------------------------
    # Markup in a message is shown as text: no element is made of it.
    question2 = "<b>Tell</b> me a <img src=x> long story."
    generated_before = generated(server.url)
    page.fill("#max-tokens", str(LONG_ANSWER_TOKENS))
    page.fill("#prompt", question2)
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    # The whole conversation goes with it: both earlier turns, then the new question.
    assert sent.value.post_data_json["messages"] == [
        *SERVER_MESSAGES, {"role": "assistant", "content": text},
        {"role": "user", "content": question2}]
    poll(lambda: page.evaluate(STREAMING_OR_FAILED), "the long answer's first characters")
    assert page.is_hidden("#error"), page.text_content("#error")
    assert page.locator("#transcript b, #transcript img").count() == 0
    assert page.locator(".turn.user .content").last.text_content() == question2

    answer = last_answer(page)
    assert running(server.url) == 1, "the long answer is not running on the server"
    assert page.is_enabled("#stop") and page.is_disabled("#send")
    page.click("#stop")
    answer.and_(page.locator("[data-state=stopped]")).wait_for()
    poll(lambda: running(server.url) == 0
         and sample(server.url, "minipaged_kv_blocks_used") == 0,
         "the server to free the stopped request")
    # Aborted, not run to its end: it left the running batch having sampled fewer
    # tokens than it was allowed (with ignore_eos nothing else ends it early), and
    # nothing is sampled after. (Not the abort counter: the metrics count an abort
    # at the engine's next step, and an idle engine takes none.)
    tokens = generated(server.url) - generated_before
    assert 5 <= tokens < LONG_ANSWER_TOKENS
    time.sleep(0.2)
    assert generated(server.url) - generated_before == tokens
    shown = answer.locator(".content").text_content()
    assert 5 <= len(shown) <= tokens   # one character a token; the last ones may not have come
    assert "stopped" in answer.locator(".stats").text_content()
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    assert page.is_hidden("#error")
