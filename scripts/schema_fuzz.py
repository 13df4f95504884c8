"""Fuzz the server's OpenAPI schema with Schemathesis: every operation, with and without the key.

    python scripts/schema_fuzz.py                      # 500 examples per operation and mode, seed 0
    python scripts/schema_fuzz.py --examples 2000 --seed 7 --max-seconds 1800

Why: the routes' request models are the only thing between a client's bytes
and the engine, and their schema (``/openapi.json``) is what client
generators and gateways read. A property-based fuzzer reads that schema,
sends bodies the schema allows (positive) and bodies it forbids (negative),
and checks every answer: never a 5xx; status codes and content types the
schema declares; a body of the declared schema; every error in OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``, a 400 naming the
field at fault; without the API key, a 401 from every ``/v1`` route.

The server is the shipped tiny model (``minipaged/assets/tiny-stdlib-llama``)
behind ``BackgroundServer`` on a free loopback port (127.0.0.1 only), with a
short context (``MAX_MODEL_LEN``) and few sequences (``MAX_NUM_SEQS``), so
no schema-valid request can make it generate more than a few hundred tokens;
the fuzzer also caps ``max_tokens``-like fields (``MAX_TOKENS_CAP``). Runs are
reproducible: Hypothesis draws from ``--seed``, with no example database.
Distinct failures (by operation, check, status and field) are collected, not
stopped at, each with the first request that showed it as a curl command;
the exit status is 1 when there is any. ``--max-seconds`` bounds the run:
the operations left when it runs out are reported as not fuzzed (exit 2).

``tests/server/test_schema_fuzz.py`` runs this with 50 examples per operation
and mode in CI; this script is the longer release check.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

API_KEY = "schema-fuzz-key"
SERVED_MODEL_NAME = "tiny-stdlib-llama"
MAX_MODEL_LEN = 64
"""The context: a prompt and its completion fit in 64 tokens, so one sequence
generates at most 63 tokens whatever ``max_tokens`` says (a larger one is a 400)."""
MAX_NUM_SEQS = 4
"""``n`` (and a beam width) above this is a 400: at most 4 sequences per prompt."""
NUM_BLOCKS = 64   # KV blocks of 16 tokens: every sequence of every running request fits
MAX_TOKENS_CAP = 8
"""The fuzzer lowers ``max_tokens`` and ``max_completion_tokens`` above this to it
(only values the schema allows anyway: the server's refusals are still fuzzed)."""
MAX_PROMPTS = 4
"""Completions with a batch of more prompts keep their first 4: each prompt runs
``n`` sequences, and a batch of 30 would only make the run slower."""
REQUEST_TIMEOUT_S = 60.0
SERVER_TIMEOUT_S = 60.0
SEED = 0

# The checks every answer gets: Schemathesis' own (a negative body must be
# refused with a 4xx), then this module's OpenAI error shape.
SCHEMA_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
                 response_headers_conformance, response_schema_conformance,
                 negative_data_rejection]


@dataclass
class Finding:
    """One distinct failure: what failed, how often, and the first request that showed it."""

    operation: str
    title: str
    status: int
    detail: str
    curl: str
    body: str
    count: int = 1

    def describe(self) -> str:
        return (f"{self.operation}: {self.title} (HTTP {self.status}, seen {self.count}x)\n"
                f"  {self.detail}\n  request: {self.curl}\n  response: {self.body[:500]}")


@dataclass
class Report:
    """What a fuzzing run did: examples sent per (operation, mode, keyed) and its findings."""

    examples: dict[tuple[str, str, bool], int] = field(default_factory=dict)
    findings: dict[tuple, Finding] = field(default_factory=dict)
    not_fuzzed: list[str] = field(default_factory=list)
    no_inputs: list[str] = field(default_factory=list)
    statuses: dict[tuple[str, bool], Counter] = field(default_factory=dict)
    """Per (operation, keyed): how often each status was answered."""

    def add(self, key: tuple, finding: Finding) -> None:
        if key in self.findings:
            self.findings[key].count += 1
        else:
            self.findings[key] = finding


# -- the server ------------------------------------------------------------------------------

def build_fuzz_app(api_key: str | None = API_KEY):
    """The server's app on the shipped tiny model, with the bounds above."""
    from minipaged.assets import default_model_dir
    from minipaged.engine import LLMEngine
    from minipaged.server import build_app

    engine = LLMEngine(str(default_model_dir()), device="cpu", attention_backend="torch",
                       num_gpu_blocks_override=NUM_BLOCKS, swap_space=0.01,
                       max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                       scheduling_policy="priority")   # so any ``priority`` is accepted
    return build_app(engine, SERVED_MODEL_NAME, api_key=api_key)


@contextmanager
def serving(api_key: str | None = API_KEY) -> Iterator[str]:
    """The fuzz app behind ``BackgroundServer`` on a free port of 127.0.0.1; yields its URL."""
    from minipaged.server import BackgroundServer

    with BackgroundServer(build_fuzz_app(api_key), host="127.0.0.1",
                          timeout_s=SERVER_TIMEOUT_S) as server:
        yield server.url


def load_schema(base_url: str):
    """The server's OpenAPI schema, as Schemathesis loads it from ``/openapi.json``."""
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=REQUEST_TIMEOUT_S)


def operations(schema) -> list:
    """Every operation of ``schema``; one the loader could not read is an error here."""
    return [result.ok() for result in schema.get_all_operations()]


# -- what every answer is checked for --------------------------------------------------------

def body_fields(case) -> set[str]:
    """The top-level fields the operation's JSON body may have (none without a body),
    read from the raw ``/openapi.json`` (the loaded schema's references are bundled)."""
    raw = case.operation.schema.raw_schema
    operation = raw["paths"][case.operation.path][case.operation.method.lower()]
    content = operation.get("requestBody", {}).get("content", {})
    schema = content.get("application/json", {}).get("schema", {})
    while "$ref" in schema:
        resolved = raw
        for part in schema["$ref"].removeprefix("#/").split("/"):
            resolved = resolved[part]
        schema = resolved
    return set(schema.get("properties", {}))


def openai_error_problems(case, status: int, content_type: str, body: Any) -> list[str]:
    """What is wrong with an error answer (status >= 400): not OpenAI's error shape,
    or a 400 that names no field of the request. Empty when nothing is."""
    if not content_type.startswith("application/json"):
        return [f"an error answered with {content_type or 'no content type'}, not JSON"]
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"}:
        return [f"not OpenAI's error shape {{'error': {{...}}}}: {str(body)[:200]}"]
    problems = []
    missing = {"message", "type", "param", "code"} - set(error)
    if missing:
        problems.append(f"the error lacks {sorted(missing)}")
    if not isinstance(error.get("message"), str) or not error.get("message"):
        problems.append("the error's message is not a non-empty string")
    if not isinstance(error.get("type"), str):
        problems.append("the error's type is not a string")
    if error.get("param") is not None and not isinstance(error.get("param"), str):
        problems.append("the error's param is neither null nor a string")
    if status == 400:
        fields = body_fields(case)
        sent = case.body if isinstance(case.body, dict) else None
        param, message = error.get("param"), str(error.get("message"))
        # A body that is not a JSON object has no field at fault: the message says so.
        names_a_field = (param in fields or any(f in message for f in fields)
                         or (sent is None and fields != set()))
        if fields and not names_a_field:
            problems.append(f"a 400 whose param ({param!r}) and message name no field of "
                            f"the request body")
    return problems


def check_error_shape(ctx, response, case) -> bool | None:
    """A Schemathesis check: every 4xx and 5xx answer is OpenAI's error body
    (``openai_error_problems``)."""
    if response.status_code < 400:
        return None
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    try:
        body = response.json()
    except ValueError:
        body = None
    problems = openai_error_problems(case, response.status_code, content_type or "", body)
    if problems:
        raise AssertionError("; ".join(problems))
    return None


# -- generation --------------------------------------------------------------------------------

def bounded(case, use_served_model: bool) -> None:
    """Keep a generated body cheap to serve, in place: ``max_tokens``-like fields
    above ``MAX_TOKENS_CAP`` lowered to it, a completions batch cut to
    ``MAX_PROMPTS``; with ``use_served_model``, ``model`` set to the served name
    (a random name is refused before anything runs, so most examples need it)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(name)
        if type(value) is int and value > MAX_TOKENS_CAP:
            body[name] = MAX_TOKENS_CAP
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        body["prompt"] = prompt[:MAX_PROMPTS]
    if use_served_model and "model" in body:
        body["model"] = SERVED_MODEL_NAME


def fuzz_operation(operation, base_url: str, report: Report, mode: GenerationMode,
                   with_key: bool, examples: int, seed: int, session: requests.Session,
                   deadline: float | None = None) -> None:
    """Send ``examples`` generated requests (``mode``) to ``operation`` and record
    every distinct failure in ``report``. Without the key, a ``/v1`` route must
    answer 401 (only the shape of its error is checked then, since the schema's
    other declarations are about answers to a caller that may call it)."""
    label = operation.label
    headers = {"Authorization": f"Bearer {API_KEY}"} if with_key else {}
    needs_key = operation.path.startswith("/v1")
    key = (label, mode.value, with_key)
    report.examples.setdefault(key, 0)
    cases = operation.as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:   # the schema's own examples first
        cases = st.one_of(*operation.get_strategies_from_examples(), cases)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              phases=[Phase.explicit, Phase.generate], print_blob=False,
              suppress_health_check=list(HealthCheck))
    @hypothesis.seed(seed)
    @hypothesis.given(case=cases, model_draw=st.integers(0, 9))
    def run(case, model_draw: int) -> None:
        if deadline is not None and time.monotonic() > deadline:
            return
        report.examples[key] += 1
        # About nine in ten examples name the served model, so the engine is reached
        # (Hypothesis favours small draws: 9, the one that keeps the drawn name, is rare).
        bounded(case, use_served_model=model_draw < 9)
        response = case.call(base_url=base_url, session=session, headers=headers,
                             timeout=REQUEST_TIMEOUT_S)
        report.statuses.setdefault((label, with_key), Counter())[response.status_code] += 1
        if not with_key and needs_key:
            checks: list[Callable] = [check_error_shape]
            if response.status_code != 401:
                record(report, case, response, "no 401 without the API key",
                       f"expected 401, got {response.status_code}", headers)
                return
        else:
            checks = SCHEMA_CHECKS + [check_error_shape]
        try:
            case.validate_response(response, checks=checks, headers=headers,
                                   transport_kwargs={"base_url": base_url, "headers": headers})
        except (AssertionError, FailureGroup) as failed:
            for title, detail in failures_of(failed):
                record(report, case, response, title, detail, headers)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        # Negative mode on an operation with no input (GET /health): nothing the
        # schema forbids can be sent, so there is nothing to fuzz.
        report.no_inputs.append(f"{label} [{mode.value}]")


def failures_of(failed: AssertionError | FailureGroup) -> list[tuple[str, str]]:
    """``(title, detail)`` of each check that failed."""
    group = getattr(failed, "exceptions", None)
    if not group:
        return [("OpenAI error shape", str(failed))]
    out = []
    for failure in group:
        title = getattr(failure, "title", type(failure).__name__)
        message = getattr(failure, "message", str(failure))
        if title == "Custom check failed: `check_error_shape`":
            title = "OpenAI error shape"
        out.append((title, message))
    return out


def record(report: Report, case, response, title: str, detail: str,
           headers: dict[str, str]) -> None:
    """Add one failure to ``report``, deduplicated by operation, check, status and
    (for an error body) the field it named."""
    try:
        param = (response.json().get("error") or {}).get("param")
    except (ValueError, AttributeError):
        param = None
    first_line = detail.splitlines()[0] if detail else ""
    key = (case.operation.label, title, response.status_code, param,
           first_line if title == "OpenAI error shape" else "")
    text = response.text if isinstance(response.text, str) else str(response.content)
    report.add(key, Finding(case.operation.label, title, response.status_code, detail,
                            case.as_curl_command(headers=headers), text))


# -- a whole run -------------------------------------------------------------------------------

def fuzz(base_url: str, examples: int, seed: int = SEED, max_seconds: float | None = None,
         modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
         key_runs: tuple[bool, ...] = (True, False), log: Callable[[str], None] | None = None
         ) -> Report:
    """Fuzz every operation of the server at ``base_url``: per operation, mode and
    key (with it, without it), ``examples`` requests. Returns the ``Report``."""
    schema = load_schema(base_url)
    report = Report()
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    with requests.Session() as session:
        for operation in operations(schema):
            for with_key in key_runs:
                for mode in modes:
                    label = f"{operation.label} [{mode.value}, {'key' if with_key else 'no key'}]"
                    if deadline is not None and time.monotonic() > deadline:
                        report.not_fuzzed.append(label)
                        continue
                    started = time.monotonic()
                    fuzz_operation(operation, base_url, report, mode, with_key, examples, seed,
                                   session, deadline)
                    if log is not None:
                        sent = report.examples[operation.label, mode.value, with_key]
                        log(f"{label}: {sent} requests in {time.monotonic() - started:.1f} s")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=500,
                   help="examples per operation, generation mode and key (default 500)")
    p.add_argument("--seed", type=int, default=SEED, help="Hypothesis' seed (default 0)")
    p.add_argument("--max-seconds", type=float, default=1200.0,
                   help="stop starting operations after this long (default 1200)")
    p.add_argument("--mode", choices=["positive", "negative", "all"], default="all")
    args = p.parse_args(argv)
    modes = {"positive": (GenerationMode.POSITIVE,), "negative": (GenerationMode.NEGATIVE,),
             "all": (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)}[args.mode]
    started = time.monotonic()
    with serving() as url:
        report = fuzz(url, args.examples, args.seed, args.max_seconds, modes,
                      log=lambda line: print(line, flush=True))
    print(f"\n{sum(report.examples.values())} requests in {time.monotonic() - started:.0f} s, "
          f"seed {args.seed}; {len(report.findings)} distinct failures")
    for (label, with_key), counts in report.statuses.items():
        print(f"{label} ({'key' if with_key else 'no key'}): statuses "
              f"{dict(sorted(counts.items()))}")
    for finding in report.findings.values():
        print("\n" + finding.describe())
    for label in report.not_fuzzed:
        print(f"not fuzzed (--max-seconds ran out): {label}")
    if report.findings:
        return 1
    return 2 if report.not_fuzzed else 0


if __name__ == "__main__":
    sys.exit(main())
