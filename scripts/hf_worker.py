"""The transformers side of ``scripts/throughput.py``: static batches and continuous batching.

    python scripts/hf_worker.py ENGINE --spec SPEC.json --result RESULT.json

Run by the throughput driver, one process per engine (``hf-generate`` or
``hf-generate-batch``); not run by hand. It reads the spec the driver wrote,
loads the Hugging Face folder it names (``model_dir``; for a GGUF source, the
folder the driver dequantized it to), runs a short warm-up, times the whole
workload ``repeats`` times and writes its record (``throughput_records.timed_result``),
with every request's output token ids from the first timed run; on any error
it writes the error instead, so the driver carries on with the other engines.
A repository script, as the vLLM worker is: it measures transformers, not
this package.
"""

from __future__ import annotations

import argparse
import time
import traceback

from minipaged.bench.harness import read_json, repeat_timed, write_json
from throughput_records import timed_result


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


def _torch_setup(spec: dict):
    import torch
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    return torch, torch.device(spec["device"]), getattr(torch, spec["dtype"])


# -- transformers: static batches ------------------------------------------------------

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
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
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
    return timed_result("hf-generate", requested, rows, clock,
                        load_seconds=load_s, warmup_seconds=warmup_s, repeat_seconds=seconds,
                        torch_threads=torch.get_num_threads(),
                        versions={"transformers": transformers.__version__},
                        engine_config=config,
                        static_batching=static_batch_accounting(requested, batch_size))


# -- transformers: continuous batching -------------------------------------------------

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


def _cb_args(config_class, spec: dict) -> dict:
    """``--hf-cb-arg`` settings, with a cache that holds the whole workload.

    By default transformers sizes its cache to most of the free memory, on a
    CPU the machine's RAM: many GBs for a 30-layer model, which on a shared
    machine pushes other processes out (or this one, into the OOM killer).
    Unless the arguments size it, the cache holds every request's prompt and
    output at once, as minipaged's and vLLM's do here.
    """
    args = dict(spec["hf_cb_args"])
    if "num_blocks" not in args and "max_memory_percent" not in args:
        page = _tokens_per_page(config_class(**args))
        args["num_blocks"] = 1 + sum(-(-(len(p) + n) // page)
                                     for p, n in zip(spec["prompts"], spec["output_lens"]))
    return args


def _tokens_per_page(config) -> int:
    """Tokens per cache page: ``page_size`` since transformers 5.18 (which
    keeps ``block_size`` as a deprecated alias), ``block_size`` before."""
    page = getattr(config, "page_size", None)
    return page if page is not None else config.block_size


def run_hf_generate_batch(spec: dict) -> dict:
    """transformers continuous batching (``generate_batch``'s engine), per-request lengths."""
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    t0 = time.perf_counter()
    torch, _, model = _load_hf(spec)
    load_s = time.perf_counter() - t0

    prompts, requested = spec["prompts"], spec["output_lens"]
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(requested),
                                  eos_token_id=-1, pad_token_id=0)
    cb_args = _cb_args(ContinuousBatchingConfig, spec)
    cb_config = ContinuousBatchingConfig(**cb_args)
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
                  "page_size": _tokens_per_page(cfg),
                  **{k: getattr(cfg, k, None) for k in
                     ("num_blocks", "max_batch_tokens", "max_requests_per_batch",
                      "use_async_batching")},
                  "args": spec["hf_cb_args"], "args_used": cb_args}
    return timed_result("hf-generate-batch", requested, rows, clock,
                        load_seconds=load_s, warmup_seconds=warmup_s, repeat_seconds=seconds,
                        torch_threads=torch.get_num_threads(),
                        versions={"transformers": transformers.__version__},
                        engine_config={k: v if isinstance(v, (int, float, str, bool, dict))
                                       or v is None else str(v) for k, v in config.items()})


WORKERS = {"hf-generate": run_hf_generate, "hf-generate-batch": run_hf_generate_batch}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=tuple(WORKERS))
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    try:
        result = WORKERS[args.engine](read_json(args.spec))
    except BaseException:  # noqa: BLE001
        # Any failure at all (an import, an interrupt) becomes the engine's result:
        # the parent records it and goes on with the other engines.
        result = {"engine": args.engine, "ok": False, "error": traceback.format_exc()[-4000:]}
    write_json(args.result, result)


if __name__ == "__main__":
    main()
