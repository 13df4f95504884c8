"""The server fuzzed against its own OpenAPI schema with Schemathesis, in CI.

Every operation of ``/openapi.json``, with and without the API key, in both
generation modes (bodies the schema allows and bodies it forbids), 50
examples each from a fixed seed: no answer may be a 5xx, break the schema,
or be an error that is not OpenAI's error body naming the field at fault
(``scripts/schema_fuzz.py`` owns the checks; run it for the longer release
check). About 20 s on the tiny model.
"""

from __future__ import annotations

import pytest

import schema_fuzz  # scripts/, on pytest's pythonpath; schemathesis is in the dev extras

EXAMPLES = 50
SEED = 0


@pytest.fixture(scope="module")
def fuzz_run():
    """One fuzzing run over every operation (about 600 requests) and its report."""
    with schema_fuzz.serving() as url:
        report = schema_fuzz.fuzz(url, EXAMPLES, SEED)
        with schema_fuzz.requests.get(f"{url}/metrics", timeout=10) as metrics:
            return report, metrics.text


def test_every_answer_keeps_to_the_schema(fuzz_run):
    report, _ = fuzz_run
    problems = "\n\n".join(f.describe() for f in report.findings.values())
    assert not report.findings, f"{len(report.findings)} distinct failures:\n{problems}"
    assert not report.not_fuzzed


def test_the_fuzzer_reached_every_route_and_the_engine(fuzz_run):
    """A run that never got past validation would find nothing: the keyed
    generation routes must have generated (200s), the unkeyed ones refused."""
    report, _ = fuzz_run
    labels = {label for label, _ in report.statuses}
    assert {"GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions",
            "POST /v1/chat/completions"} <= labels
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        keyed = report.statuses[route, True]
        assert keyed[200] >= 10, f"{route}: {dict(keyed)}"
        assert keyed[400] >= 10, f"{route}: {dict(keyed)}"   # the negative bodies
        assert set(report.statuses[route, False]) == {401}
    assert sum(report.examples.values()) >= 400


def test_the_engine_holds_nothing_after_the_run(fuzz_run):
    """Every fuzzed request ended: no request is running or waiting, no block is held."""
    _, metrics = fuzz_run
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines() if line and not line.startswith("#")}
    assert gauges["minipaged_num_requests_running"] == 0
    assert gauges["minipaged_num_requests_waiting"] == 0
    assert gauges["minipaged_kv_blocks_used"] == 0
