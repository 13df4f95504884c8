"""Load an OpenAI-compatible server over HTTP and time what a client sees
(``minipaged bench serve``).

Any server that speaks the OpenAI streaming API works: minipaged's
(``minipaged serve``), vLLM's (``vllm serve``), SGLang's, llama.cpp's. The
client sends ``--num-prompts`` streamed requests to ``/v1/chat/completions``
or ``/v1/completions``, started at Poisson arrivals of ``--request-rate`` per
second (``inf``: all at once), at most ``--max-concurrency`` in flight, and
reports request, output-token and total-token throughput, time to first
token (TTFT), time per output token after the first (TPOT), the gaps between
streamed chunks (ITL) and end-to-end latency as mean, median and p99, and the
requests that failed. Token counts are the server's own (``stream_options:
{include_usage: true}``); a server that sends no usage has its content
chunks counted instead, one token each.

Every request ends: an HTTP error, an error in the stream, a dropped
connection or ``--timeout`` seconds makes it a failed request, recorded with
its reason, so the run always ends. The in-process benchmark of the paper's
figures is another one, ``minipaged.bench.serving``.

    minipaged bench serve --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --num-prompts 64 --request-rate 4 --ignore-eos --result-file out.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from .chat_prompts import CHAT_PROMPTS
from .harness import cpu_description, write_json

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PERCENTILES = (50, 99)
# The words random prompts are drawn from: the chat prompts' own, so that a
# tokenizer splits them as it splits ordinary English (about one token a word).
WORDS = tuple(sorted({w.strip(".,?!:'\"()").lower() for p in CHAT_PROMPTS for w in p.split()}
                     - {""}))


@dataclass
class Request:
    """One request to send: the prompt (the user message of a one-message chat,
    or a completion's prompt text) and how many tokens to ask for."""
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    """What the client saw of one request; times in seconds, ``start`` from the
    start of the run, the others from the request's own start."""
    index: int
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None          # first chunk that carried generated text
    latency: float | None = None       # the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int | None = None   # the server's usage, when it sent one
    output_tokens: int = 0             # the server's usage, else content chunks
    content_chunks: int = 0
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        """Decode time per token after the first; None with fewer than two tokens."""
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# -- the requests ---------------------------------------------------------------------

def chat_requests(num: int, max_tokens: int) -> list[Request]:
    """``num`` of the repository's chat prompts, in order, cycling."""
    return [Request(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_tokens) for i in range(num)]


def long_tailed_lengths(rng: random.Random, num: int, median: int) -> list[int]:
    """``num`` lengths, log-normal around ``median`` (sigma 0.5), clipped to
    [1, 4 x median]: ShareGPT's prompt and answer lengths are long-tailed, as
    these are, rather than uniform."""
    return [min(4 * median, max(1, round(rng.lognormvariate(math.log(median), 0.5))))
            for _ in range(num)]


def random_requests(num: int, input_len: int, output_len: int, seed: int) -> list[Request]:
    """``num`` prompts of random words and output lengths from ``seed``: the
    same seed gives the same requests. The client has no tokenizer, so
    ``input_len`` counts words; the server's usage says how many tokens they
    made."""
    rng = random.Random(seed)
    inputs = long_tailed_lengths(rng, num, input_len)
    outputs = long_tailed_lengths(rng, num, output_len)
    return [Request(" ".join(rng.choices(WORDS, k=n)), m) for n, m in zip(inputs, outputs)]


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """When each request starts, in seconds from the start of the run: a Poisson
    process of ``rate`` requests/s (exponential gaps, the first request at 0)
    drawn from ``seed``, so a rerun starts them at the same moments; all at 0
    for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng, t, offsets = random.Random(seed), 0.0, []
    for i in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def request_body(endpoint: str, model: str, request: Request, args) -> dict:
    """The JSON body of one streamed request. ``ignore_eos`` is vLLM's extra
    sampling field (minipaged and SGLang read it too): every request then
    generates exactly ``max_tokens``, so two servers do the same work."""
    body = {"model": model, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


# -- one request ----------------------------------------------------------------------

def chunk_text(chunk: dict) -> str:
    """The generated text in one streamed chunk (a chat delta's content, or its
    reasoning for a server that splits it off, or a completion's text)."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if delta is not None:
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
    return text


async def read_stream(lines, outcome: Outcome, t0: float, clock=time.perf_counter) -> None:
    """Fill ``outcome`` from the server-sent events in ``lines`` (an async
    iterator of text lines); ``t0``: when the request was sent, on ``clock``.

    TTFT is taken at the first chunk with text, as users see it (a chat
    stream may open with a role-only chunk), and ITL between content chunks.
    A stream that ends without ``[DONE]`` or carries an ``error`` fails."""
    last = None
    done = False
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[len("data:"):].strip()
        now = clock()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            outcome.error = f"error in the stream: {json.dumps(chunk['error'])[:300]}"
            return
        if chunk.get("usage"):
            outcome.usage_reported = True
            outcome.prompt_tokens = chunk["usage"].get("prompt_tokens")
            outcome.output_tokens = chunk["usage"].get("completion_tokens") or 0
        if chunk_text(chunk):
            outcome.content_chunks += 1
            if last is None:
                outcome.ttft = now - t0
            else:
                outcome.itl.append(now - last)
            last = now
    if not done:
        outcome.error = "the stream ended before [DONE]"
        return
    outcome.latency = clock() - t0
    if outcome.ttft is None:  # nothing but an empty answer: its only token came at the end
        outcome.ttft = outcome.latency
    if not outcome.usage_reported:
        outcome.output_tokens = outcome.content_chunks
    outcome.ok = True


async def send(client, url: str, headers: dict, body: dict, outcome: Outcome,
               timeout: float) -> Outcome:
    """Send one request and read its stream into ``outcome``; whatever goes
    wrong (status, transport, the stream, ``timeout`` seconds in all) is
    recorded as its ``error``, never raised, so one bad request cannot stop
    or hang the run."""
    t0 = time.perf_counter()

    async def exchange():
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                outcome.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            await read_stream(response.aiter_lines(), outcome, t0)

    try:
        await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        outcome.error = f"timed out after {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 -- any failure is this request's result
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
    if outcome.error is not None:
        outcome.ok, outcome.latency = False, time.perf_counter() - t0
    return outcome


# -- the run --------------------------------------------------------------------------

def httpx_module():
    try:
        import httpx
    except ImportError as exc:  # a dependency of the tests, not of the engine
        raise SystemExit("minipaged bench serve needs httpx: pip install httpx") from exc
    return httpx


async def run_requests(args, requests: list[Request]) -> tuple[list[Outcome], float, int]:
    """Send every request at its arrival time, at most ``max_concurrency`` at
    once; returns the outcomes (in request order), the run's duration (first
    start to last end) and the most requests that were in flight together."""
    httpx = httpx_module()
    url = args.base_url.rstrip("/") + ENDPOINTS[args.endpoint]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(requests) or 1
    gate = asyncio.Semaphore(limit)
    offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
    in_flight, peak = 0, 0
    bar = progress_bar(len(requests), args.disable_tqdm)
    # One connection per request that may be in flight: none waits for a
    # connection inside httpx, where its time would count as the server's.
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        for i in range(args.num_warmups):  # one at a time, before the clock starts
            body = request_body(args.endpoint, args.model, requests[i % len(requests)], args)
            warm = await send(client, url, headers, body, Outcome(-1 - i), args.timeout)
            if not warm.ok:
                print(f"warm-up request failed: {warm.error}", flush=True)
        start = time.perf_counter()

        async def one(i: int, request: Request) -> Outcome:
            nonlocal in_flight, peak
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with gate:
                in_flight += 1
                peak = max(peak, in_flight)
                outcome = Outcome(i, start=time.perf_counter() - start)
                await send(client, url, headers, request_body(args.endpoint, args.model,
                                                              request, args),
                           outcome, args.timeout)
                in_flight -= 1
            bar.update(1)
            return outcome

        outcomes = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
    bar.close()
    return list(outcomes), duration, peak


def progress_bar(total: int, disable: bool):
    from tqdm import tqdm
    return tqdm(total=total, disable=disable, desc="requests", unit="req")


# -- the metrics ----------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile, interpolated linearly between the two nearest
    ranks (numpy's default), of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values: list[float]) -> dict:
    """Mean, median and p99 of ``values`` (seconds) in milliseconds; None for
    each when there is nothing to summarize (every request failed)."""
    if not values:
        return {"mean": None, "median": None, "p99": None, "count": 0}
    ms = [v * 1e3 for v in values]
    return {"mean": statistics.fmean(ms), "median": percentile(ms, 50),
            "p99": percentile(ms, 99), "count": len(ms)}


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    """The run's metrics from its outcomes. Throughputs count only requests
    that completed; ITL pools every gap of every completed request."""
    done = [o for o in outcomes if o.ok]
    prompt_tokens = sum(o.prompt_tokens or 0 for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    return {
        "completed": len(done), "failed": len(outcomes) - len(done),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "input_tokens_reported": all(o.prompt_tokens is not None for o in done),
        "output_tokens_from_usage": all(o.usage_reported for o in done),
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(prompt_tokens + output_tokens),
        "ttft_ms": distribution_ms([o.ttft for o in done]),
        "tpot_ms": distribution_ms([o.tpot for o in done if o.tpot is not None]),
        "itl_ms": distribution_ms([gap for o in done for gap in o.itl]),
        "e2el_ms": distribution_ms([o.latency for o in done]),
        "errors": sorted({o.error for o in outcomes if o.error})[:10],
    }


def table(metrics: dict) -> str:
    """The metrics as a two-column text table."""
    def num(value, digits=2):
        return "n/a" if value is None else f"{value:,.{digits}f}"

    rows = [("Successful requests", str(metrics["completed"])),
            ("Failed requests", str(metrics["failed"])),
            ("Duration (s)", num(metrics["duration_s"])),
            ("Total input tokens", f"{metrics['total_input_tokens']:,}"),
            ("Total output tokens", f"{metrics['total_output_tokens']:,}"),
            ("Request throughput (req/s)", num(metrics["request_throughput"])),
            ("Output token throughput (tok/s)", num(metrics["output_throughput"])),
            ("Total token throughput (tok/s)", num(metrics["total_token_throughput"]))]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2el_ms", "E2E latency")):
        rows += [(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms)",
                  num(metrics[key][stat])) for stat in ("mean", "median", "p99")]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value:>12}" for name, value in rows]
    rule = "-" * len(lines[0])
    return "\n".join([rule, *lines, rule] + [f"error: {e}" for e in metrics["errors"]])


def record(args, metrics: dict, outcomes: list[Outcome], peak: int) -> dict:
    """The JSON record: the arguments, the server, the date, this machine's CPU
    (the client shares it with a local server), the metrics and each request."""
    per_request = [{k: v for k, v in asdict(o).items() if k != "itl"} | {"itl_count": len(o.itl)}
                   for o in outcomes]
    return {"benchmark": "serve", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "base_url": args.base_url, "endpoint": ENDPOINTS[args.endpoint],
            "model": args.model, "arguments": {  # inf as "inf": JSON has no infinity
                k: "inf" if v == math.inf else v for k, v in vars(args).items()
                if k != "api_key"},
            "machine": {"cpu": cpu_description(), "python": platform.python_version()},
            "peak_concurrency": peak, "metrics": metrics, "requests": per_request}


# -- the command ----------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minipaged bench serve",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, without /v1 (default %(default)s)")
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="chat")
    p.add_argument("--dataset", choices=("chat", "random"), default="chat",
                   help="chat: the repository's chat prompts, in order; random: prompts "
                        "of random words with long-tailed lengths from --seed")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals from --seed (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit)")
    p.add_argument("--max-tokens", type=int, default=64, help="per request (chat dataset)")
    p.add_argument("--random-input-len", type=int, default=64,
                   help="median prompt length in words (random dataset)")
    p.add_argument("--random-output-len", type=int, default=64,
                   help="median max_tokens (random dataset)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly max_tokens (vLLM's ignore_eos field)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one request may take in all before it counts as failed")
    p.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent one by one before the timed run, not counted")
    p.add_argument("--result-file", default=None, help="write the JSON record here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def build_requests(args) -> list[Request]:
    if args.dataset == "chat":
        return chat_requests(args.num_prompts, args.max_tokens)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.seed)


def main(argv: list[str] | None = None) -> dict:
    """Run the load, print the table, write ``--result-file``; returns the record."""
    args = parser().parse_args(argv)
    if args.num_prompts < 1 or args.request_rate <= 0 or (args.max_concurrency or 1) < 1:
        raise SystemExit("--num-prompts, --request-rate and --max-concurrency must be positive")
    outcomes, duration, peak = asyncio.run(run_requests(args, build_requests(args)))
    metrics = summarize(outcomes, duration)
    print(table(metrics), flush=True)
    result = record(args, metrics, outcomes, peak)
    if args.result_file:
        write_json(args.result_file, result)
        print(f"wrote {args.result_file}", flush=True)
    return result


if __name__ == "__main__":
    main()
