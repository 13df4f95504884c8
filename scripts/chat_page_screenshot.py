"""Screenshot of the server's chat page in use: ``assets/chat_page.png``.

Serves the default model (SmolLM2-135M-Instruct when its wheel is installed,
else the shipped tiny model) in this process, as ``minipaged serve`` would,
opens ``/chat`` in Debian's headless Chromium through Playwright
(``apt-get install chromium``, ``pip install playwright``; never
``playwright install``), has a two-turn chat, greedily, and saves the page once
the last streamed answer has ended. tests/server/test_chat_page.py drives the same
page; this only takes the picture.

    python scripts/chat_page_screenshot.py [--model PATH] [--out assets/chat_page.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from minipaged.engine import LLMEngine
from minipaged.server import BackgroundServer, build_app
from minipaged.server.cli import engine_args, model_and_name, parse_args

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SYSTEM = "You are a helpful assistant. Answer in a few sentences."
# Two turns: the second question leans on the first answer, as a chat does.
QUESTIONS = ["What is the capital of France?", "Name three things it is famous for."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="what `minipaged serve` takes (default: its)")
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "chat_page.png")
    p.add_argument("--question", action="append", default=None,
                   help="a question to ask (repeat for more turns; default: two)")
    p.add_argument("--max-tokens", type=int, default=120)
    args = p.parse_args()

    from playwright.sync_api import expect, sync_playwright

    serve_args = parse_args([args.model] if args.model else [])
    model, name = model_and_name(serve_args)
    engine = LLMEngine.from_engine_args(model, engine_args(serve_args))
    try:
        with BackgroundServer(build_app(engine, name), timeout_s=120) as srv, \
                sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 960, "height": 600},
                                    device_scale_factor=1)
            page.set_default_timeout(120_000)   # a CPU answer of 120 tokens: seconds
            page.goto(srv.url + "/chat")
            expect(page.locator("#model")).to_have_text(name)
            page.fill("#system", SYSTEM)
            page.fill("#temperature", "0")
            page.fill("#max-tokens", str(args.max_tokens))
            for turn, question in enumerate(args.question or QUESTIONS):
                page.fill("#prompt", question)
                page.press("#prompt", "Enter")
                page.locator(".turn.assistant").nth(turn).and_(
                    page.locator("[data-state=done]")).wait_for()
            page.locator("#prompt").blur()   # no focus ring in the picture
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
            for stats in page.locator(".turn.assistant .stats").all_text_contents():
                print(stats)
            browser.close()
    finally:
        engine.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
