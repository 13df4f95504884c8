"""EngineArgs, the one source of the engine's options: its defaults are the
engine's, every option is documented, the command line is generated from it
and reads back to it, bad values and unknown names are refused, and the
README lists every option and docs/serving.md every `serve` flag."""

import argparse
import asyncio
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

# Not on every machine (the GPU machine lacks it): skip, do not fail collecting.
pytest.importorskip("fastapi")  # minipaged.server.cli below

from minipaged import LLM
from minipaged.assets import default_model_dir
from minipaged.async_engine import AsyncLLMEngine
from minipaged.config import CacheConfig, SchedulerConfig
from minipaged.engine import LLMEngine
from minipaged.engine_args import EngineArgs
from minipaged.models.loader import load_hf_config
from minipaged.server import cli

README = Path(__file__).resolve().parents[2] / "README.md"
SERVING = Path(__file__).resolve().parents[2] / "docs" / "serving.md"   # the serve flags
NAMES = [f.name for f in dataclasses.fields(EngineArgs)]
BOOLS = {"enforce_eager", "enable_prefix_caching", "admission_headroom", "prepack_weights"}

# The defaults of LLMEngine's keyword arguments before EngineArgs existed.
TODAYS_DEFAULTS = dict(
    dtype="auto", device="auto", block_size=16, gpu_memory_utilization=0.9,
    num_gpu_blocks_override=None, swap_space=4, preemption_mode="recompute",
    enable_prefix_caching=True, max_num_seqs=256, max_num_batched_tokens=None,
    max_model_len=None, attention_backend="auto", enforce_eager=True, prepack_weights=True,
    seed=0, kv_policy="paged", admission_headroom=False, tensor_parallel_size=1,
    pipeline_parallel_size=1, scheduling_policy="fcfs", kv_cache_dtype="auto",
    quantization="auto", speculative_config=None)

# A value other than the default for every option, and its command-line spelling.
OTHER_VALUES = dict(
    dtype="float16", device="cpu", block_size=32, gpu_memory_utilization=0.5,
    num_gpu_blocks_override=64, swap_space=0.25, preemption_mode="swap",
    enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=512,
    max_model_len=128, attention_backend="torch", enforce_eager=False, prepack_weights=False,
    seed=7, kv_policy="max", admission_headroom=True, tensor_parallel_size=2,
    pipeline_parallel_size=2, scheduling_policy="priority", kv_cache_dtype="fp8",
    quantization="int8", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')


def argv_of(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = EngineArgs.flag(name)
        if name in BOOLS:
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:   # None: the flag left out
            argv += [flag, str(value)]
    return argv


# -- defaults ----------------------------------------------------------------------------

def test_defaults_are_the_engines_of_before():
    assert sorted(NAMES) == sorted(TODAYS_DEFAULTS)
    assert EngineArgs().to_kwargs() == TODAYS_DEFAULTS


def test_config_classes_defaults_equal_engine_args():
    """CacheConfig() and SchedulerConfig() keep defaults (tests and pool_size build
    them bare); they must be EngineArgs'."""
    assert CacheConfig() == EngineArgs().cache_config()
    assert SchedulerConfig() == EngineArgs().scheduler_config()
    args = EngineArgs(**OTHER_VALUES)
    assert args.cache_config() == CacheConfig(
        block_size=32, gpu_memory_utilization=0.5, num_gpu_blocks_override=64,
        swap_space=0.25, enable_prefix_caching=False, kv_policy="max", kv_cache_dtype="fp8")
    assert args.scheduler_config() == SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=512, preemption_mode="swap",
        admission_headroom=True, scheduling_policy="priority")


def test_engine_ends_up_with_the_defaults():
    """A tiny model on the CPU with nothing but the pool size given: what the
    defaults resolve to, and the same engine from EngineArgs, sync and async."""
    model = default_model_dir()
    engine = LLMEngine(model, device="cpu", num_gpu_blocks_override=32)
    args = EngineArgs(device="cpu", num_gpu_blocks_override=32)
    assert engine.engine_args == args
    assert engine.cache_config == dataclasses.replace(CacheConfig(), num_gpu_blocks_override=32)
    assert engine.cache_config.block_size == 16 and engine.cache_config.swap_space == 4
    assert engine.cache_config.enable_prefix_caching is True
    assert engine.scheduler_config == SchedulerConfig()
    assert engine.scheduler_config.token_budget == 2048
    assert engine.cache_config.kv_policy == "paged" and engine.enforce_eager is True
    assert engine.tensor_parallel_size == 1
    assert engine.device == torch.device("cpu") and engine.dtype == torch.float32
    assert engine.attention_backend == "torch"
    assert engine.model_config.max_model_len == load_hf_config(model).max_position_embeddings
    assert engine.stats.total_blocks == 32

    again = LLMEngine.from_engine_args(model, args)
    assert again.engine_args == args and again.cache_config == engine.cache_config
    assert again.scheduler_config == engine.scheduler_config

    chosen = dataclasses.replace(args, max_num_seqs=4, preemption_mode="swap", seed=3)
    async_engine = AsyncLLMEngine.from_engine_args(model, chosen)
    try:
        assert async_engine.engine.engine_args == chosen
        assert async_engine.engine.scheduler_config.max_num_seqs == 4
        assert async_engine.engine.scheduler_config.preemption_mode == "swap"
    finally:
        asyncio.run(async_engine.shutdown())


# -- documentation -----------------------------------------------------------------------

@pytest.mark.parametrize("cls", [LLMEngine, LLM])
def test_signature_lists_the_options(cls):
    """help(LLM) and inspect.signature show every option with its default, though
    the engine takes them as **kwargs."""
    params = inspect.signature(cls).parameters
    assert list(params)[0] == "model"
    options = {name: p.default for name, p in params.items() if name != "model"}
    assert options == EngineArgs().to_kwargs()
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "model")


@pytest.mark.parametrize("name", NAMES)
def test_every_option_is_documented(name):
    field = next(f for f in dataclasses.fields(EngineArgs) if f.name == name)
    assert len(field.metadata["help"]) > 20
    assert EngineArgs.help(name) == field.metadata["help"]
    if "choices" in field.metadata:
        assert field.default in field.metadata["choices"]


def test_readme_lists_every_option_and_the_serving_guide_every_flag():
    text = README.read_text()
    options = text[text.index("- engine options"):text.index("- outputs:")]
    guide = SERVING.read_text()
    flags = guide[guide.index("and the engine options, one flag per"):guide.index("Routes:")]
    flags = " ".join(flags.split())   # the list wraps over lines
    for name in NAMES:
        assert f"`{name}`" in options, f"README's engine options lack {name}"
        flag = EngineArgs.flag(name)
        if name in BOOLS:
            flag += "/--no-" + flag[2:]
        assert re.search(re.escape(flag) + r"[ `]", flags), (
            f"docs/serving.md's serve flags lack {flag}")


# -- the command line --------------------------------------------------------------------

def test_cli_round_trips():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    parsed = EngineArgs.from_cli_args(parser.parse_args(argv_of(OTHER_VALUES)))
    assert parsed == EngineArgs(**OTHER_VALUES)
    flipped = {name: not TODAYS_DEFAULTS[name] for name in BOOLS}
    assert EngineArgs.from_cli_args(parser.parse_args(argv_of(flipped))) == EngineArgs(**flipped)
    assert EngineArgs.from_cli_args(parser.parse_args(argv_of(TODAYS_DEFAULTS | {
        "num_gpu_blocks_override": 1}))) == EngineArgs(num_gpu_blocks_override=1)


def test_cli_refuses_what_is_not_a_choice(capsys):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for argv in (["--preemption-mode", "drop"], ["--attention-backend", "cuda"],
                 ["--kv-policy", "none"], ["--block-size", "sixteen"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert "invalid" in capsys.readouterr().err


def test_serve_flags_come_from_engine_args():
    """Serve's own flags stay; every engine flag of before keeps its name and
    default; the options it did not expose appear."""
    args = cli.parse_args([])
    assert (args.model, args.host, args.port, args.served_model_name) == (
        None, "127.0.0.1", 8000, None)
    assert cli.engine_args(args) == EngineArgs()
    assert cli.engine_kwargs(args) == TODAYS_DEFAULTS
    before = ["--dtype", "float32", "--device", "cpu", "--block-size", "8",
              "--num-gpu-blocks-override", "32", "--swap-space", "0.5", "--max-num-seqs", "4",
              "--max-model-len", "256", "--attention-backend", "reference",
              "--no-enable-prefix-caching", "--seed", "5", "--tensor-parallel-size", "2"]
    assert cli.engine_kwargs(cli.parse_args(["some/dir", *before, "--port", "9"])) == (
        TODAYS_DEFAULTS | dict(
            dtype="float32", device="cpu", block_size=8, num_gpu_blocks_override=32,
            swap_space=0.5, max_num_seqs=4, max_model_len=256, attention_backend="reference",
            enable_prefix_caching=False, seed=5, tensor_parallel_size=2))
    new = ["--preemption-mode", "swap", "--max-num-batched-tokens", "512",
           "--gpu-memory-utilization", "0.5", "--no-enforce-eager"]
    assert cli.engine_args(cli.parse_args(new)) == EngineArgs(
        preemption_mode="swap", max_num_batched_tokens=512, gpu_memory_utilization=0.5,
        enforce_eager=False)
    assert cli.engine_args(cli.parse_args(argv_of(OTHER_VALUES))) == EngineArgs(**OTHER_VALUES)


# -- bad values and unknown names --------------------------------------------------------

BAD = [("block_size", 3), ("block_size", 512), ("gpu_memory_utilization", 0.0),
       ("gpu_memory_utilization", 1.5), ("num_gpu_blocks_override", 0), ("swap_space", -1),
       ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("preemption_mode", "drop"),
       ("admission_headroom", "yes"), ("kv_policy", "none"), ("kv_cache_dtype", "fp16")]


@pytest.mark.parametrize("name, value", BAD)
def test_bad_value_names_the_field(name, value, tmp_path):
    """Refused by EngineArgs, before any model is looked for."""
    with pytest.raises(ValueError, match=name):
        EngineArgs(**{name: value})
    with pytest.raises(ValueError, match=name):
        LLMEngine(tmp_path / "no-such-model", **{name: value})


@pytest.mark.parametrize("name, value", [
    ("device", "tpu"), ("dtype", "int8"), ("attention_backend", "cuda"),
    ("max_model_len", 10**9), ("tensor_parallel_size", 0)])
def test_bad_value_the_engine_resolves_names_the_field(name, value):
    """The options checked against the model and the machine, before any weights load."""
    kwargs = {"device": "cpu", name: value}
    with pytest.raises(ValueError, match=name):
        LLMEngine(default_model_dir(), **kwargs)


def test_unknown_option_is_a_type_error(tmp_path):
    for build in (EngineArgs, lambda **kw: LLMEngine(tmp_path, **kw),
                  lambda **kw: LLM(tmp_path, **kw)):
        with pytest.raises(TypeError, match="block_sise"):
            build(block_sise=16)
    with pytest.raises(TypeError):
        EngineArgs("auto")   # keyword-only, as LLMEngine's were


def test_engine_args_are_frozen():
    args = EngineArgs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.block_size = 32
    assert dataclasses.replace(args, block_size=32).block_size == 32
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(args, block_size=5)
