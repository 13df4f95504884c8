"""vLLM worker of ``scripts/throughput.py``: run by file path under vLLM's interpreter.

    VLLM_PYTHON vllm_worker.py --spec SPEC.json --result RESULT.json

vLLM lives in its own virtual environment (its CPU build pins its own
torch), where minipaged is not installed: this script imports only the
standard library, vLLM, ``throughput_records`` and the benchmarks' harness
(``harness``, which imports only the standard library at module level). The
driver copies this file, ``throughput_records.py`` and
``minipaged/bench/harness.py`` into a folder of their own and runs it from
there; it is a repository script, not part of the package, because no
interpreter that has minipaged ever imports it. It
loads the Hugging Face folder named in the spec (``model_dir``; for a GGUF
source, the folder the driver dequantized it to: vLLM's CPU build does not
read GGUF), runs a short warm-up, then times ``LLM.generate`` over every
request (token-id prompts, greedy, EOS ignored, no detokenization) and
writes the result, with the first run's output token ids; on any error it
writes the error text instead, so the parent can carry on with the other
engines.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from harness import read_json, repeat_timed, write_json

from throughput_records import timed_result


def run(spec: dict) -> dict:
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    # No tokenizer needed (a random checkpoint has none): the driver sends token ids, the
    # same ones every engine gets, and outputs are compared as token ids, not text.
    # Prefix caching off, as for minipaged: the repeated runs send the same prompts.
    args = {"model": spec["model_dir"], "skip_tokenizer_init": True, "dtype": spec["dtype"],
            "enable_prefix_caching": False,
            "seed": spec["seed"], **spec["vllm_args"]}
    llm = LLM(**args)
    load_s = time.perf_counter() - t0

    def params(n: int):
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)

    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in spec["warmup_prompts"]],
                 [params(spec["warmup_tokens"])] * len(spec["warmup_prompts"]), use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    requested = spec["output_lens"]
    sampling = [params(n) for n in requested]
    clock, outputs, seconds = repeat_timed(
        spec["repeats"], lambda: llm.generate(prompts, sampling, use_tqdm=False))

    versions = {"vllm": vllm.__version__, "python": sys.version.split()[0]}
    try:  # vLLM's own torch and transformers, which may differ from the parent's
        import torch
        import transformers
        versions.update(torch=torch.__version__, transformers=transformers.__version__)
        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    return timed_result("vllm", requested, [list(o.outputs[0].token_ids) for o in outputs],
                        clock,
                        load_seconds=load_s, warmup_seconds=warmup_s, repeat_seconds=seconds,
                        torch_threads=threads,
                        versions=versions, engine_config={"LLM": {k: v for k, v in args.items()
                                                                  if k != "model"}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    try:
        result = run(read_json(args.spec))
    except BaseException:  # noqa: BLE001
        # Any failure at all becomes the result: the parent records it and goes on.
        result = {"engine": "vllm", "ok": False, "error": traceback.format_exc()[-4000:]}
    write_json(args.result, result)


if __name__ == "__main__":
    main()
