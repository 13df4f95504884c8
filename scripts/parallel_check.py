"""Tensor and pipeline parallelism on CUDA, launched by ``torchrun``: each
layout's greedy tokens against one process's.

    python scripts/parallel_check.py --out parallel.json

The CPU tests run both over gloo; NCCL (the CUDA backend) runs only on a
GPU machine, so ``gpu_check`` calls this there. The layouts are those the
machine's GPUs allow: TP=1 x PP=1 through the ``torchrun`` path on one GPU;
TP=2 and PP=2 on two; TP=2 x PP=2 on four. Each runs a small random LLaMA
(4 layers, float32) under ``torchrun --standalone`` and must produce the
same greedy tokens as an engine in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from minipaged.bench.harness import arguments, build_model, save_record

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40)]
MAX_TOKENS = 24
# Nothing is preempted (256 blocks hold every sequence), so the swap pool, pinned
# host memory on CUDA, is kept small: the default 4 GiB per rank would pin 16 at TP=2 x PP=2.
ENGINE = dict(device="cuda", dtype="float32", num_gpu_blocks_override=256, max_model_len=128,
              swap_space=0.01)

SCRIPT = textwrap.dedent(f"""
    import json, sys
    from minipaged import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]),
              pipeline_parallel_size=int(sys.argv[3]), **{ENGINE!r})
    outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}],
                        SamplingParams(temperature=0, max_tokens={MAX_TOKENS}, ignore_eos=True),
                        use_tqdm=False)
    json.dump([o.outputs[0].token_ids for o in outs], open(sys.argv[4], "w"))
    llm.close()
""")


def layouts(num_gpus: int) -> list[tuple[int, int]]:
    """``(tp, pp)`` pairs that fit ``num_gpus`` devices, one rank per device."""
    chosen = [(1, 1)]
    if num_gpus >= 2:
        chosen += [(2, 1), (1, 2)]
    if num_gpus >= 4:
        chosen.append((2, 2))
    return chosen


SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def one_process_tokens(path: Path) -> list[list[int]]:
    from minipaged import LLM, SamplingParams

    with LLM(str(path), **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_layout(root: Path, tp: int, pp: int, timeout: float) -> dict:
    """One ``torchrun --standalone`` run of ``tp x pp`` processes on this machine."""
    out = root / f"tp{tp}_pp{pp}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp * pp}", str(root / "script.py"), str(root / "model"),
           str(tp), str(pp), str(out)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        code, log = None, f"no result within {timeout:.0f} s"
    tokens = json.loads(out.read_text()) if out.is_file() else None
    return dict(tp=tp, pp=pp, exit_code=code, seconds=round(time.time() - t0, 1),
                tokens=tokens, log_tail=None if code == 0 else log[-2000:])


def main(argv=None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per layout")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("parallel_check needs CUDA")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_model(root / "model", SHAPE)
        (root / "script.py").write_text(SCRIPT)
        expected = one_process_tokens(root / "model")
        runs = [run_layout(root, tp, pp, args.timeout)
                for tp, pp in layouts(torch.cuda.device_count())]
    for r in runs:
        r["equal_to_one_process"] = r.pop("tokens") == expected
    record = dict(gpu=torch.cuda.get_device_name(), num_gpus=torch.cuda.device_count(),
                  date=time.strftime("%Y-%m-%d"), torch=torch.__version__, runs=runs)
    save_record(record, args.out)
    return record


def summary_lines(record: dict) -> list[str]:
    return [f"TP={r['tp']} x PP={r['pp']}: "
            + ("PASS" if r["equal_to_one_process"] else f"FAIL (exit {r['exit_code']})")
            + f", {r['seconds']} s" for r in record["runs"]]


if __name__ == "__main__":
    main()
