"""Throughput: output tokens/s of minipaged and its peers, same model, same requests.

    python -m minipaged.bench.throughput                      # CPU or CUDA, whichever is here
    python -m minipaged.bench.throughput --vllm-python /work/peers/vllm-cpu/bin/python
    python -m minipaged.bench.throughput --engines minipaged,hf-generate --num-requests 32
    python -m minipaged.bench.throughput --minipaged-arg max_num_seqs=64   # try an engine option
    python -m minipaged.bench.throughput --quick              # a tiny run, to check it works

Engines, each in a process of its own and one at a time (on a small machine
two engines at once would slow each other down):

* ``minipaged``: ``LLM.generate`` over every request (``attention_backend="auto"``).
  Prefix caching is off here and in vLLM: the requests share no prefix, and
  the repeated timed runs send the same prompts, which a cache would serve.
* ``hf-generate``: transformers' ``model.generate`` in static batches of
  ``--hf-batch-size`` requests in trace order, prompts left-padded with an
  attention mask; each batch runs to its longest requested output, and only
  each request's requested tokens count.
* ``hf-generate-batch``: transformers' continuous batching, the engine behind
  ``model.generate_batch``. ``generate_batch`` takes one ``max_new_tokens``
  for all prompts, so this drives the same manager the way ``generate_batch``
  does (``continuous_batching_context_manager``, ``add_request``,
  ``get_result``) with each request's own ``max_new_tokens``.
* ``vllm``: only with ``--vllm-python`` (or ``MINIPAGED_VLLM_PYTHON``), an
  interpreter with vLLM installed; ``_vllm_worker.py`` runs there.

The model is a random-weight ``LlamaForCausalLM`` written with
``save_pretrained`` (safetensors, no tokenizer: prompts are token ids and no
engine detokenizes). On CPU a small fp32 model serves a ShareGPT-like trace
(``minipaged.bench.workloads``); on CUDA a TinyLlama-1.1B-shaped model in
bf16 serves 256 requests with prompt and output lengths uniform in
100..1024, as nano-vllm's benchmark does. Every request is greedy with EOS
ignored, so each produces exactly its requested number of tokens; a worker
checks that and records what it got. A worker loads the model, runs a short
warm-up, then times from submitting the requests to the last one finishing,
``--repeats`` times (default 3); the median run counts, and every run's time
is recorded.
Writes ``throughput_<device>.json`` (machine, date, versions, model,
workload, per-engine results, ratios) and ``throughput_<device>.png`` to
``--out`` (default ``assets/``) and prints the table last.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from ._throughput_common import (FIRST_TOKENS, cpu_busy_seconds, read_json, repeat_timed,
                                 timed_result, write_json)

ENGINES = ("minipaged", "hf-generate", "hf-generate-batch", "vllm")
HF_ENGINES = ("hf-generate", "hf-generate-batch")
REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_WORKER = Path(__file__).with_name("_vllm_worker.py")

# LlamaConfig arguments. CPU: small enough that the whole default run (four
# engines, each loading and warming up in a fresh process) takes about two
# minutes on 2 cores, big enough that a step is mostly model work; GQA as in
# current models. CUDA: TinyLlama-1.1B's shape. Quick: about as small as runs
# (vLLM's CPU attention wants a head size of at least 32). Tiny: quick's shape
# with a 2048-token context, for bench.serving (its step time barely grows with
# the batch, so memory limits serving, as on a GPU).
MODELS = {
    "quick": dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256),
    "cpu": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048),
    "cuda": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
}
MODELS["tiny"] = dict(MODELS["quick"], max_position_embeddings=2048)
# Default request count and ShareGPT-like length cap (prompt and output each up
# to half of it) per setting; the CUDA workload has fixed ranges instead.
WORKLOADS = {"quick": (6, 64), "cpu": (64, 512), "cuda": (256, None)}
UNIFORM_RANGE = (100, 1024)  # CUDA: nano-vllm's prompt and output lengths
WARMUP_PROMPTS, WARMUP_PROMPT_LEN, WARMUP_TOKENS = 2, 8, 4
BUSY_CORES = 0.25  # other processes' CPU use (in cores) that makes a run suspect


# -- the model and the requests ------------------------------------------------

def build_model(path: Path, shape: dict, dtype: str, device: str, seed: int = 0) -> Path:
    """Write a random ``LlamaForCausalLM`` of ``shape`` in ``dtype`` to ``path``.

    Built on ``device`` (a 1.1B model initializes in seconds on a GPU, a
    minute on a CPU), from ``seed``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the "Writing model shards" bar: noise in a benchmark log
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    with torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(path))
    return path


def make_workload(setting: str, num_requests: int, max_len: int | None, vocab: int,
                  seed: int) -> dict:
    """Prompts (token ids) and output lengths, the same for every engine."""
    from .workloads import random_prompt_ids, sharegpt_like

    if setting == "cuda":
        lo, hi = UNIFORM_RANGE
        rng = np.random.default_rng(seed)
        prompt_lens = rng.integers(lo, hi + 1, size=num_requests)
        output_lens = rng.integers(lo, hi + 1, size=num_requests)
        prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in prompt_lens]
        description = f"{num_requests} requests, prompt and output lengths uniform in {lo}..{hi}"
    else:
        trace = sharegpt_like(num_requests, seed=seed, max_len=max_len)
        prompts = random_prompt_ids(trace, vocab, seed)
        output_lens = [r.output_len for r in trace]
        description = (f"{num_requests} ShareGPT-like requests (sharegpt_like, seed {seed}, "
                       f"max_len {max_len}: prompt and output each <= {max_len // 2})")
    output_lens = [int(n) for n in output_lens]
    return {"description": description, "num_requests": num_requests, "max_len": max_len,
            "seed": seed, "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(output_lens), "prompts": prompts, "output_lens": output_lens}


def static_batches(num_requests: int, batch_size: int) -> list[range]:
    """Request indices of each static batch, in trace order."""
    return [range(i, min(i + batch_size, num_requests))
            for i in range(0, num_requests, batch_size)]


def static_batch_accounting(output_lens: list[int], batch_size: int) -> dict:
    """What static batching costs: each batch decodes to its longest request.

    ``decode_steps``: the sum of the batches' longest outputs;
    ``generated_tokens``: rows times steps, every token a batch computes;
    ``requested_tokens``: the ones that count; ``discarded_share``: the rest.
    """
    steps = generated = 0
    for batch in static_batches(len(output_lens), batch_size):
        longest = max(output_lens[i] for i in batch)
        steps += longest
        generated += longest * len(batch)
    requested = sum(output_lens)
    return {"batch_size": batch_size, "decode_steps": steps, "generated_tokens": generated,
            "requested_tokens": requested,
            "discarded_share": 1 - requested / generated if generated else 0.0}


# -- workers (each runs in its own process) -------------------------------------

def _torch_setup(spec: dict):
    import torch
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    return torch, torch.device(spec["device"]), getattr(torch, spec["dtype"])


def run_minipaged(spec: dict) -> dict:
    """``minipaged.LLM.generate`` over every request at once."""
    torch, device, dtype = _torch_setup(spec)
    from .. import LLM, SamplingParams, __version__

    t0 = time.perf_counter()
    # Prefix caching off (in vLLM too): the requests share no prefix, and a
    # repeat of the same prompts would otherwise be served from the cache.
    args = {"attention_backend": "auto", "seed": spec["seed"], "enable_prefix_caching": False,
            **spec["minipaged_args"]}
    llm = LLM(spec["model_dir"], device=spec["device"], dtype=dtype, **args)
    load_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in spec["warmup_prompts"]],
                 params(spec["warmup_tokens"]), use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    requested = spec["output_lens"]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    sampling = [params(n) for n in requested]
    clock, outputs, seconds = repeat_timed(
        spec["repeats"], lambda: llm.generate(prompts, sampling, use_tqdm=False))
    tokens = [o.outputs[0].token_ids for o in outputs]
    engine, stats = llm.engine, llm.engine.stats
    config = {**args, "attention_backend_resolved": engine.attention_backend,
              "max_num_seqs": engine.scheduler_config.max_num_seqs,
              "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
              "kv_blocks": stats.total_blocks, "block_size": engine.cache_config.block_size}
    return timed_result("minipaged", requested, [len(t) for t in tokens],
                        [list(t[:FIRST_TOKENS]) for t in tokens], clock,
                        load_seconds=load_s, warmup_seconds=warmup_s, repeat_seconds=seconds,
                        torch_threads=torch.get_num_threads(), versions={"minipaged": __version__},
                        engine_config=config,
                        engine_stats={"steps": stats.num_steps,
                                      "preemptions": stats.num_preemptions,
                                      "peak_used_blocks": stats.peak_used_blocks})


def _load_hf(spec: dict):
    torch, device, dtype = _torch_setup(spec)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(device).eval()
    # EOS off for good: requests are never cut short, whatever generate's defaults.
    model.generation_config.eos_token_id = None
    return torch, device, model


def _generate_static(torch, model, device, prompts: list[list[int]], n: int,
                     pad_id: int = 0) -> list[list[int]]:
    """One static batch through ``model.generate``: left-padded, greedy,
    exactly ``n`` new tokens per row. Returns each row's new tokens."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding: every row's last token lines up
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=pad_id)
    return out[:, width:].tolist()


def run_hf_generate(spec: dict) -> dict:
    """transformers ``model.generate`` in static batches, in trace order."""
    import transformers

    t0 = time.perf_counter()
    torch, device, model = _load_hf(spec)
    load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    _generate_static(torch, model, device, spec["warmup_prompts"], spec["warmup_tokens"])
    warmup_s = time.perf_counter() - t0

    prompts, requested = spec["prompts"], spec["output_lens"]
    batch_size = spec["hf_batch_size"]
    def run_all() -> list[list[int]]:
        rows: list[list[int]] = []
        for batch in static_batches(len(prompts), batch_size):
            longest = max(requested[i] for i in batch)
            rows += _generate_static(torch, model, device, [prompts[i] for i in batch], longest)
        return rows

    clock, rows, seconds = repeat_timed(spec["repeats"], run_all)
    config = {"batch_size": batch_size, "padding": "left, with attention mask",
              "attn_implementation": model.config._attn_implementation,
              "max_new_tokens": "min_new_tokens = the batch's longest requested output",
              "counted": "each request's requested tokens only"}
    return timed_result("hf-generate", requested, [len(r) for r in rows],
                        [r[:FIRST_TOKENS] for r in rows], clock,
                        load_seconds=load_s, warmup_seconds=warmup_s, repeat_seconds=seconds,
                        torch_threads=torch.get_num_threads(),
                        versions={"transformers": transformers.__version__},
                        engine_config=config,
                        static_batching=static_batch_accounting(requested, batch_size))


def _cb_generate(manager, prompts: list[list[int]], lens: list[int], tag: str) -> list[list[int]]:
    """Submit every request to a running continuous-batching manager, each with
    its own ``max_new_tokens`` and no EOS (-1), and wait for all of them."""
    ids = [manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n, eos_token_id=-1)
           for i, (p, n) in enumerate(zip(prompts, lens))]
    if None in ids:
        raise RuntimeError("the continuous batching manager refused a request")
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"the continuous batching loop stopped after {len(done)} of "
                                   f"{len(ids)} requests")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id}: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
    return [done[i] for i in ids]


def run_hf_generate_batch(spec: dict) -> dict:
    """transformers continuous batching (``generate_batch``'s engine), per-request lengths."""
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    t0 = time.perf_counter()
    torch, device, model = _load_hf(spec)
    load_s = time.perf_counter() - t0

    prompts, requested = spec["prompts"], spec["output_lens"]
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(requested),
                                  eos_token_id=-1, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(**spec["hf_cb_args"])
    # The hints generate_batch itself would give for this call (they size the cache).
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                          max_generated_length=max(requested), num_requests=len(prompts))
    t0 = time.perf_counter()
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=cb_config, block=True,
            timeout=30, workload_hints=hints) as manager:
        warm = spec["warmup_prompts"]
        _cb_generate(manager, warm, [spec["warmup_tokens"]] * len(warm), "warmup")
        warmup_s = time.perf_counter() - t0  # includes the manager's start-up and cache sizing
        repeat = iter(range(max(1, spec["repeats"])))  # request ids stay unique across runs
        clock, rows, seconds = repeat_timed(
            spec["repeats"], lambda: _cb_generate(manager, prompts, requested, f"r{next(repeat)}-"))
        cfg = manager.continuous_batching_config
        config = {"api": "continuous_batching_context_manager + add_request(max_new_tokens="
                         "per request) + get_result: generate_batch's loop with per-request "
                         "lengths (generate_batch takes one max_new_tokens for all)",
                  "attn_implementation": model.config._attn_implementation,
                  **{k: getattr(cfg, k, None) for k in
                     ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
                      "use_async_batching")},
                  "args": spec["hf_cb_args"]}
    return timed_result("hf-generate-batch", requested, [len(r) for r in rows],
                        [r[:FIRST_TOKENS] for r in rows], clock,
                        load_seconds=load_s, warmup_seconds=warmup_s, repeat_seconds=seconds,
                        torch_threads=torch.get_num_threads(),
                        versions={"transformers": transformers.__version__},
                        engine_config={k: v if isinstance(v, (int, float, str, bool, dict))
                                       or v is None else str(v) for k, v in config.items()})


WORKERS = {"minipaged": run_minipaged, "hf-generate": run_hf_generate,
           "hf-generate-batch": run_hf_generate_batch}


def worker_main(engine: str, spec_path: str, result_path: str) -> None:
    """In the worker process: run one engine, write its result (or its error)."""
    try:
        result = WORKERS[engine](read_json(spec_path))
    except BaseException:  # the parent records the error and goes on with the others
        result = {"engine": engine, "ok": False, "error": traceback.format_exc()[-4000:]}
    write_json(result_path, result)


# -- the parent: one worker process per engine ----------------------------------

def worker_command(engine: str, spec: Path, result: Path, device: str,
                   vllm_python: str | None, threads: int | None = None) -> tuple[list[str], dict]:
    """The command line and environment of ``engine``'s worker."""
    env = dict(os.environ)
    if threads:  # every engine's OpenMP pool the same size
        env["OMP_NUM_THREADS"] = str(threads)
    # The test suite sets TRITON_INTERPRET=1 on CPU for the kernel tests; a
    # benchmark measures the real path (with it, "auto" would pick the
    # interpreted Triton kernels).
    env.pop("TRITON_INTERPRET", None)
    if engine == "vllm":
        env.pop("PYTHONPATH", None)  # vLLM's venv must see only its own packages
        if device == "cpu":
            # The settings that ran best on 2 cores: a KV cache of 4 GiB, OpenMP
            # threads bound to every core, the engine in this process.
            env.update(VLLM_CPU_KVCACHE_SPACE="4",
                       VLLM_CPU_OMP_THREADS_BIND=f"0-{(threads or os.cpu_count() or 1) - 1}",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0")
        # Run from a folder of its own: a script's folder goes first on sys.path, and
        # minipaged/bench holds modules (kernels.py) that would shadow vLLM's imports.
        folder = spec.parent / "vllm_worker"
        folder.mkdir(exist_ok=True)
        for source in (VLLM_WORKER, VLLM_WORKER.with_name("_throughput_common.py")):
            shutil.copy(source, folder / source.name)
        return [vllm_python, str(folder / VLLM_WORKER.name), "--spec", str(spec),
                "--result", str(result)], env
    # This checkout's minipaged, whatever copy of it is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "minipaged.bench.throughput", "--worker", engine,
            "--spec", str(spec), "--result", str(result)], env


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_for_quiet(max_wait: float) -> dict:
    """Wait (at most ``max_wait`` seconds) until other processes leave the CPUs
    nearly idle, so an engine does not start while the machine is busy.

    Called between workers, when this benchmark itself is idle: the machine's
    busy CPU time over a ``window`` is then other processes' use.
    """
    t0 = time.perf_counter()
    window = 1.0 if max_wait > 0 else 0.2  # not waiting: only a glance, for the record
    others = None
    while True:
        before = cpu_busy_seconds()
        time.sleep(window)
        after = cpu_busy_seconds()
        if before is None or after is None:
            break
        others = (after - before) / window
        if others <= BUSY_CORES or time.perf_counter() - t0 >= max_wait:
            break
    return {"waited_seconds": round(time.perf_counter() - t0, 1),
            "other_cores_at_start": None if others is None else round(others, 2)}


def run_engine(engine: str, spec: Path, workdir: Path, device: str, timeout: float,
               vllm_python: str | None, threads: int | None = None) -> dict:
    """Run one engine's worker to completion (or ``timeout``) and read its result."""
    result_path, log = workdir / f"{engine}.result.json", workdir / f"{engine}.log"
    cmd, env = worker_command(engine, spec, result_path, device, vllm_python, threads)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        # Its own session, so that a timeout ends the worker and anything it started.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if result_path.is_file():
        result = read_json(result_path)
    elif proc.returncode == -signal.SIGKILL:
        result = {"engine": engine, "ok": False, "error": f"timed out after {timeout:.0f} s"}
    else:
        result = {"engine": engine, "ok": False,
                  "error": f"worker exited with {proc.returncode} and no result"}
    if not result.get("ok"):
        result.setdefault("log_tail", _tail(log))
    result["process_seconds"] = time.perf_counter() - t0
    return result


def summarize(results: dict[str, dict]) -> dict:
    """tokens/s per engine that ran, minipaged's ratio to each other engine,
    the better transformers path, and how often engines agree on first tokens."""
    rates = {e: r["tokens_per_s"] for e, r in results.items() if r.get("ok")}
    summary: dict = {"tokens_per_s": rates}
    ours = rates.get("minipaged")
    if ours is not None:
        summary["minipaged_over"] = {e: ours / v for e, v in rates.items() if e != "minipaged"}
    hf = {e: rates[e] for e in HF_ENGINES if e in rates}
    if hf:
        best = max(hf, key=hf.get)
        summary["best_transformers"] = {"engine": best, "tokens_per_s": hf[best]}
        if ours is not None:
            summary["best_transformers"]["minipaged_over"] = ours / hf[best]
    # Greedy on random weights: logits are nearly flat, so rounding differences
    # soon change the argmax. The first token still shows that two engines ran
    # the same model on the same prompts.
    ref = results.get("minipaged", {}).get("first_tokens")
    if ref:
        summary["first_token_agreement_with_minipaged"] = {
            e: sum(a[:1] == b[:1] for a, b in zip(ref, r["first_tokens"])) / len(ref)
            for e, r in results.items() if r.get("ok") and e != "minipaged"}
    return summary


def format_table(record: dict) -> list[str]:
    lines = [f"{'engine':<18}{'tok/s':>9}{'seconds':>9}{'tokens':>8}{'minipaged/x':>12}  note"]
    over = record["summary"].get("minipaged_over", {})
    for engine, r in record["results"].items():
        if not r.get("ok"):
            # the last line of a traceback is the exception
            error = (r.get("error") or "").strip().splitlines() or [""]
            lines.append(f"{engine:<18}{'-':>9}{'-':>9}{'-':>8}{'-':>12}  FAILED: "
                         f"{error[-1][:80]}")
            continue
        ratio = 1.0 if engine == "minipaged" else over.get(engine)
        note = []
        if r["short_requests"]:
            note.append(f"{r['short_requests']} requests got fewer tokens than requested")
        elif not r["exact"] and "static_batching" not in r:
            note.append("more tokens than requested")  # only the requested ones counted
        if "static_batching" in r:
            note.append(f"batches of {r['static_batching']['batch_size']}, "
                        f"{r['static_batching']['discarded_share']:.0%} of tokens discarded")
        machine = r.get("machine", {})
        if (machine.get("other_cores") or 0) > BUSY_CORES:
            note.append(f"other processes took {machine['other_cores']:.2f} cores")
        lines.append(f"{engine:<18}{r['tokens_per_s']:>9.1f}{r['seconds']:>9.2f}"
                     f"{r['produced_tokens']:>8}{'' if ratio is None else f'{ratio:.2f}':>12}"
                     f"  {'; '.join(note)}")
    best = record["summary"].get("best_transformers")
    if best and "minipaged_over" in best:
        lines.append(f"minipaged / best transformers path ({best['engine']}): "
                     f"{best['minipaged_over']:.2f}x")
    return lines


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(record["results"])
    rates = [record["results"][e].get("tokens_per_s", 0.0) if record["results"][e].get("ok")
             else 0.0 for e in engines]
    over = record["summary"].get("minipaged_over", {})
    colors = ["tab:blue" if e == "minipaged" else "tab:gray" for e in engines]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    bars = ax.bar(engines, rates, color=colors)
    for engine, bar, rate in zip(engines, bars, rates):
        r = record["results"][engine]
        if not r.get("ok"):
            label = "failed"
        elif engine in over:
            label = f"{rate:.0f}\nminipaged {over[engine]:.2f}x"
        else:
            label = f"{rate:.0f}"
        if (r.get("machine", {}).get("other_cores") or 0) > BUSY_CORES:
            label += "\n(machine busy)"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(0, max(rates + [1.0]) * 1.25)
    env, model, work = record["environment"], record["model"], record["workload"]
    ax.set_title(f"{model['description']}\n{work['description']}", fontsize=8)
    vllm = env.get("vllm_environment", {}).get("vllm")
    fig.suptitle(f"{env['device']} · {env['date']} · minipaged {env['minipaged_git']} · torch "
                 f"{env['torch']} · transformers {env['transformers']}"
                 + (f" · vLLM {vllm}" if vllm else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_engine_args(items: list[str]) -> dict:
    """``key=value`` pairs; values as Python literals where they parse
    (``64``, ``0.5``, ``True``/``true``, ``None``), else strings."""
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item!r}")
        raw = {"true": "True", "false": "False", "none": "None"}.get(raw.lower(), raw)
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def machine_description(device) -> dict:
    """``environment()`` with a device name that fits this benchmark."""
    import torch
    import transformers

    from .timing import environment

    info = {**environment(device), "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if device.type == "cpu":
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        info["device"] = f"{name} CPU, {os.cpu_count()} cores"
    info["minipaged_git"] = _git_describe()
    return info


def _git_describe() -> str | None:
    """This checkout's commit, with "+changes" when files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if dirty else "")) or None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=None,
                        help=f"comma-separated subset of {','.join(ENGINES)} (default: all "
                             f"available; vllm needs --vllm-python)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None,
                        help="CPU trace: cap on prompt + output (each at most half)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--minipaged-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra minipaged.LLM argument, e.g. max_num_seqs=64 (repeatable)")
    parser.add_argument("--hf-cb-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="transformers ContinuousBatchingConfig argument (repeatable)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra vllm.LLM argument (repeatable)")
    parser.add_argument("--vllm-python", default=os.environ.get("MINIPAGED_VLLM_PYTHON"),
                        help="interpreter with vLLM installed (default $MINIPAGED_VLLM_PYTHON)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for every engine (default: torch's, one per core)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs of the workload per engine (after one warm-up); the "
                             "median counts (default 3, 1 with --quick)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    parser.add_argument("--max-wait", type=float, default=30,
                        help="seconds to wait, before each engine, for other processes to "
                             "leave the CPUs idle (0: do not wait)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 6 short requests: checks that it works")
    parser.add_argument("--out", default="assets", help="folder for throughput_<device>.json/.png")
    # Internal: the parent runs itself with these to make a worker.
    parser.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def choose_engines(parser, args) -> list[str]:
    vllm_ok = bool(args.vllm_python) and Path(args.vllm_python).is_file()
    if args.engines is None:
        return [e for e in ENGINES if e != "vllm" or vllm_ok]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    if "vllm" in engines and not vllm_ok:
        parser.error(f"--engines vllm needs --vllm-python (an existing interpreter), got "
                     f"{args.vllm_python!r}")
    return engines


def main(argv=None) -> dict | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.spec, args.result)
        return None
    from ..config import resolve_device

    device = resolve_device(args.device)
    engines = choose_engines(parser, args)
    setting = "quick" if args.quick else device.type
    args.repeats = args.repeats or (1 if args.quick else 3)
    dtype = args.dtype if args.dtype != "auto" else (
        "bfloat16" if device.type == "cuda" else "float32")
    num_requests, max_len = WORKLOADS[setting]
    num_requests = args.num_requests or num_requests
    max_len = args.max_len or max_len
    shape = MODELS[setting]
    workload = make_workload(setting, num_requests, max_len, shape["vocab_size"], args.seed)
    warmup = np.random.default_rng(args.seed + 1).integers(
        0, shape["vocab_size"], size=(WARMUP_PROMPTS, WARMUP_PROMPT_LEN)).tolist()
    try:
        engine_args = {"minipaged_args": parse_engine_args(args.minipaged_arg),
                       "hf_cb_args": parse_engine_args(args.hf_cb_arg),
                       "vllm_args": parse_engine_args(args.vllm_arg)}
    except ValueError as e:
        parser.error(str(e))

    results = {}
    with tempfile.TemporaryDirectory(prefix="minipaged-throughput-") as tmp:
        workdir = Path(tmp)
        t0 = time.perf_counter()
        model_dir = build_model(workdir / "model", shape, dtype,
                                device.type if setting == "cuda" else "cpu", seed=args.seed)
        print(f"model written in {time.perf_counter() - t0:.1f} s; {workload['description']}",
              flush=True)
        spec = workdir / "spec.json"
        write_json(spec, {"model_dir": str(model_dir), "device": device.type, "dtype": dtype,
                          "seed": args.seed, "prompts": workload["prompts"],
                          "output_lens": workload["output_lens"], "warmup_prompts": warmup,
                          "warmup_tokens": WARMUP_TOKENS, "hf_batch_size": args.hf_batch_size,
                          "threads": args.threads, "repeats": args.repeats,
                          **engine_args})
        for engine in engines:
            quiet = wait_for_quiet(args.max_wait)
            waited = (f" (waited {quiet['waited_seconds']:.0f} s for other processes to quiet "
                      f"down; they use {quiet['other_cores_at_start']} cores)"
                      if quiet["waited_seconds"] > 2 else "")
            print(f"{engine}: running ...{waited}", flush=True)
            r = run_engine(engine, spec, workdir, device.type, args.timeout, args.vllm_python,
                           args.threads)
            r["start"] = quiet
            results[engine] = r
            if r.get("ok"):
                print(f"{engine}: {r['tokens_per_s']:.1f} tok/s ({r['produced_tokens']} tokens in "
                      f"{r['seconds']:.2f} s; process {r['process_seconds']:.0f} s)", flush=True)
            else:
                print(f"{engine}: FAILED\n{r.get('error', '')[-1500:]}", flush=True)

    params = _num_params(shape)
    record = {
        "benchmark": "throughput",
        "unit": "output tokens/s (requested tokens only), wall clock from submitting the "
                "requests to the last one finishing, after loading and a warm-up; the median "
                f"of {args.repeats} timed run(s) of the whole workload",
        "environment": machine_description(device),
        "model": {"description": _model_description(shape, dtype, params), "config": shape,
                  "dtype": dtype, "parameters": params, "weights": "random (seed "
                  f"{args.seed}), LlamaForCausalLM.save_pretrained (safetensors), no tokenizer"},
        "workload": {k: v for k, v in workload.items() if k not in ("prompts",)},
        "sampling": "greedy (temperature 0), EOS ignored, token-id prompts, no detokenization",
        "engines_run": engines,
        "engines_not_run": {e: "not asked for" if args.engines else "no --vllm-python given"
                            for e in ENGINES if e not in engines},
        "warmup": f"{WARMUP_PROMPTS} prompts of {WARMUP_PROMPT_LEN} tokens, {WARMUP_TOKENS} "
                  f"output tokens each",
        "engine_args": engine_args,
        "threads": args.threads or "torch default",
        "results": results,
        "summary": summarize(results),
    }
    vllm = results.get("vllm", {}).get("versions")
    if vllm:  # vLLM runs in its own environment, with its own torch and transformers
        record["environment"]["vllm_environment"] = vllm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"throughput_{device.type}.json", record)
    plot(record, out / f"throughput_{device.type}.png")
    print(f"wrote {out / f'throughput_{device.type}.json'} and .png")
    print("\n".join(format_table(record)))
    return record


def _num_params(shape: dict) -> int:
    """Parameters of an untied Llama of this shape (no biases)."""
    h, v, i, n = (shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"],
                  shape["num_hidden_layers"])
    head = h // shape["num_attention_heads"]
    attn = h * h * 2 + 2 * h * head * shape["num_key_value_heads"]
    return 2 * v * h + n * (attn + 3 * h * i + 2 * h) + h


def _model_description(shape: dict, dtype: str, params: int) -> str:
    return (f"random LLaMA {params / 1e6:.1f}M params, {dtype}: {shape['num_hidden_layers']} "
            f"layers, hidden {shape['hidden_size']}, {shape['num_attention_heads']} heads / "
            f"{shape['num_key_value_heads']} KV, intermediate {shape['intermediate_size']}, "
            f"vocab {shape['vocab_size']}")


if __name__ == "__main__":
    main()
