"""The serving benchmark: the knee search, the per-request metrics, and the two
request classes under FCFS and priority (``scripts/serving_classes.py``; a quick
real run of every figure is in test_bench_sweeps)."""

import pytest

from minipaged.bench import serving


def _fake(knee: float, finished_until: float = float("inf")):
    calls = []

    def measure(rate):
        calls.append(rate)
        # flat below the knee, exploding above it
        return (1.0 if rate <= knee else 10.0 * rate / knee), rate <= finished_until
    return measure, calls


def test_knee_search_doubles_then_bisects():
    measure, calls = _fake(knee=20.0)
    best, tried = serving.search_knee(measure, 4.0, bound=3.0, max_rates=6, refine=2)
    # 4, 8, 16 good, 32 bad; then 24 bad, 20 good
    assert tried == calls == [4.0, 8.0, 16.0, 32.0, 24.0, 20.0]
    assert best == 20.0


def test_knee_search_halves_when_the_start_fails():
    measure, _ = _fake(knee=1.0)
    # 4, 2 bad, 1 good; then 1.5 bad
    assert serving.search_knee(measure, 4.0, bound=3.0) == (1.0, [4.0, 2.0, 1.0, 1.5])
    measure, _ = _fake(knee=0.1)
    assert serving.search_knee(measure, 4.0, bound=3.0, max_rates=3) == (None, [4.0, 2.0, 1.0])


def test_knee_search_edges():
    measure, _ = _fake(knee=1e9)
    assert serving.search_knee(measure, 1.0, bound=3.0, max_rates=3) == (4.0, [1.0, 2.0, 4.0])
    # an unfinished trace fails whatever its latency, and a callable bound is read late
    measure, _ = _fake(knee=1e9, finished_until=2.0)
    best, tried = serving.search_knee(measure, 1.0, bound=lambda: 3.0, max_rates=5, refine=1)
    assert (best, tried) == (2.0, [1.0, 2.0, 4.0, 3.0])


def test_request_metrics():
    m = serving.request_metrics(arrival=10.0, first_token=10.5, finished=12.5, output_tokens=5)
    assert m["ttft"] == pytest.approx(0.5)
    assert m["tpot"] == pytest.approx(0.5)
    assert m["normalized_latency"] == pytest.approx(0.5)
    assert m["latency"] == pytest.approx(2.5)
    assert serving.request_metrics(0.0, None, None, 0)["normalized_latency"] is None


# -- two classes under FCFS and priority (scripts/serving_classes.py) --------------------

def test_class_trace_is_seeded_and_mixes_both_classes():
    import serving_classes as sc

    trace, class_of = sc.class_trace(40, 10.0, sc.CLASSES, seed=3)
    again, class_again = sc.class_trace(40, 10.0, sc.CLASSES, seed=3)
    assert trace == again and class_of == class_again
    assert set(class_of.values()) == set(sc.CLASSES)
    for r in trace:
        spec = sc.CLASSES[class_of[r.request_id]]
        assert spec["prompt"][0] <= r.prompt_len <= spec["prompt"][1]
        assert spec["output"][0] <= r.output_len <= spec["output"][1]
    assert all(a.arrival_time < b.arrival_time for a, b in zip(trace, trace[1:]))


def test_classes_under_fcfs_and_priority():
    """A contrived overload: six batch jobs arrive just before six chats, all at
    time 0, and the pool holds about three batch jobs. FCFS admits the jobs
    first and the chats wait behind the first job that does not fit; priority
    admits the chats at once. Compared by order (which step gave a request its
    first token), not by how many seconds it took, so a slow moment of the
    machine cannot flip it."""
    import serving_classes as sc
    from minipaged.bench.workloads import TraceRequest, random_prompt_ids

    trace = ([TraceRequest(str(i), 0.0, 80, 24) for i in range(6)]
             + [TraceRequest(str(i), 0.0, 8, 4) for i in range(6, 12)])
    class_of = {r.request_id: "batch" if int(r.request_id) < 6 else "interactive"
                for r in trace}
    # trace_max_len: the engines' two warm-up requests stay short
    bench = serving.ServingBench(dict(sc.SETTINGS["quick"], trace_max_len=32), seed=0)
    try:
        prompts = random_prompt_ids(trace, bench.shape["vocab_size"], 0)
        runs = {p: [sc.serve_classes(bench, trace, prompts, class_of, sc.QUICK_CLASSES, p,
                                     f"t{p}-")] for p in sc.SCHEDULING_POLICIES}
    finally:
        bench.close()
    summary = sc.summarize(runs, sc.QUICK_CLASSES)
    first = {}  # per policy and class: every request's TTFT (all arrived together)
    for policy in sc.SCHEDULING_POLICIES:
        assert runs[policy][0]["finished_all"]
        for name in ("interactive", "batch"):
            s = summary[policy][name]
            assert s["requests"] == s["finished"] == 6
            for key in ("latency", "ttft", "tpot"):
                assert 0 <= s[f"mean_{key}"] <= s[f"p99_{key}"]
            first[policy, name] = [r["ttft"] for r in runs[policy][0]["requests"]
                                   if r["class"] == name]
    # FCFS: every chat waits until after the first jobs' first tokens.
    assert min(first["fcfs", "interactive"]) > min(first["fcfs", "batch"])
    # Priority: no job gets a token before every chat has had its first.
    assert max(first["priority", "interactive"]) <= min(first["priority", "batch"])
