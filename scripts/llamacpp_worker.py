"""The llama.cpp side of ``scripts/quantization_bench.py``: one request at a time.

    LLAMA_PYTHON scripts/llamacpp_worker.py --spec SPEC.json --result RESULT.json

Run by the driver under an interpreter that has ``llama-cpp-python``
(docs/quantization.md says how to build one); it needs nothing
of minipaged, so that environment needs no torch. It loads the GGUF file the
spec names with the spec's thread count, then serves each request's prompt
token ids greedily (top-k 1) for exactly its number of output tokens (end of
text ignored, as minipaged's side does), one after the other, and writes the
tokens/s and every request's output token ids.
"""

from __future__ import annotations

import argparse
import json
import time


def generate(llm, prompt: list[int], num_tokens: int) -> list[int]:
    """``num_tokens`` greedy tokens after ``prompt`` (llama.cpp's cache reset first)."""
    out = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == num_tokens:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    import llama_cpp

    llm = llama_cpp.Llama(spec["model"], n_threads=spec["threads"], n_ctx=spec["n_ctx"],
                          n_batch=512, verbose=False, seed=0)
    generate(llm, spec["prompts"][0], 8)   # warm-up
    start = time.perf_counter()
    outputs = [generate(llm, p, n) for p, n in zip(spec["prompts"], spec["output_lens"])]
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    with open(args.result, "w") as f:
        json.dump({"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
                   "threads": spec["threads"], "seconds": seconds, "tokens": tokens,
                   "tokens_per_s": tokens / seconds, "outputs": outputs}, f)


if __name__ == "__main__":
    main()
