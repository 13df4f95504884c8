"""Train the tiny LLaMA that ships with minipaged, so the demo prints real text.

Corpus: the ``*.py`` files of the Python standard library found on this
machine (``sysconfig.get_paths()["stdlib"]``), skipping ``test/`` folders and
``site-packages``. Licence of the corpus: the Python Software Foundation License.

Steps:
1. train a byte-level BPE tokenizer (``tokenizers``), vocabulary 4096, with
   ``<s>`` (bos), ``</s>`` (eos) and ``<pad>``;
2. train a ``transformers.LlamaForCausalLM`` of about 5M parameters on CPU
   (fp32 weights, bf16 autocast for the matmuls, AdamW, linear warm-up then
   cosine decay) for a fixed number of steps;
3. save config, fp16 weights, tokenizer and a README in Hugging Face format.

Data order and initial weights are seeded and the step count is fixed, so a
rerun on the same machine and torch build gives the same weights. On a 2-core
AMD EPYC VM with AVX512-BF16 the default 4000 steps take about 14 minutes; on
a CPU without native bf16, pass ``--dtype fp32`` (slower per step).

    python scripts/train_tiny_model.py
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sysconfig
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "minipaged" / "assets" / "tiny-stdlib-llama"
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files, tests and site-packages left out, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "idle_test"}
    return sorted(p for p in root.rglob("*.py")
                  if not skip.intersection(p.relative_to(root).parts))


def read_corpus(files: list[Path], max_bytes: int) -> list[str]:
    """File texts in path order, stopping once ``max_bytes`` are read (keeps tokenizing quick)."""
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files are Latin-1 or unreadable: not worth special-casing
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer that prepends ``<s>`` to each encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Prompts start with <s> like every training file does.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def encode_corpus(tok, texts: list[str]) -> torch.Tensor:
    """One long 1-D id stream: ``<s> file </s> <s> file </s> ...``, shape ``[num_tokens]``."""
    eos = tok.token_to_id("</s>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """``batch`` random windows of ``seq_len + 1`` tokens, shape ``[batch, seq_len + 1]``."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine to 10% of ``peak``."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, batch: int, seq_len: int, batches: int) -> float:
    """Mean next-token loss on seeded windows of a held-out stream."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        x = random_windows(stream, batch, seq_len, gen)
        losses.append(_loss(model, x).item())
    model.train()
    return sum(losses) / len(losses)


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy for windows ``x`` of shape ``[batch, seq_len + 1]``."""
    logits = model(input_ids=x[:, :-1]).logits  # [batch, seq_len, vocab]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             x[:, 1:].reshape(-1))


def write_portable_tokenizer_class(out: Path) -> None:
    """Name the tokenizer class that transformers 4.x and 5.x both resolve.

    transformers 5 writes ``TokenizersBackend``, which 4.x does not know; both
    load ``PreTrainedTokenizerFast`` from a ``tokenizer.json``. A
    ``special_tokens_map.json`` (4.x writes one) only repeats the config.
    """
    import json
    (out / "special_tokens_map.json").unlink(missing_ok=True)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4000, help="optimizer steps")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="matmul precision under autocast (weights and optimizer stay fp32)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-corpus-mb", type=float, default=24.0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    for name, value, low in (("--steps", args.steps, 1), ("--threads", args.threads, 1),
                             ("--vocab-size", args.vocab_size, 259), ("--seq-len", args.seq_len, 8),
                             ("--batch", args.batch, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")

    from tqdm.auto import tqdm
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    files = stdlib_files()
    # Shuffle files (seeded) so the held-out tail is not one package only.
    random.Random(args.seed).shuffle(files)
    texts = read_corpus(files, int(args.max_corpus_mb * 1e6))
    print(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f} M characters "
          f"from {sysconfig.get_paths()['stdlib']}")
    t0 = time.perf_counter()
    tok = train_tokenizer(texts, args.vocab_size)
    stream = encode_corpus(tok, texts)
    split = int(stream.numel() * 0.98)
    train_stream, val_stream = stream[:split], stream[split:]
    print(f"tokenizer: {tok.get_vocab_size()} tokens, corpus {stream.numel() / 1e6:.2f} M tokens "
          f"({time.perf_counter() - t0:.0f} s)")

    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len * 2, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: LLaMA {n_params / 1e6:.2f} M parameters")
    # No weight decay on norms (1-D weights), the usual AdamW split.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.0, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    start = time.perf_counter()
    smoothed = None
    model.train()
    for step in tqdm(range(1, args.steps + 1), desc="training", unit="step", mininterval=5):
        lr = lr_at(step / args.steps, args.lr, warmup=0.05)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            loss = _loss(model, random_windows(train_stream, args.batch, args.seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % 250 == 0 or step == args.steps:
            tqdm.write(f"step {step:5d}  loss {smoothed:.3f}  lr {lr:.2e}  "
                       f"{(time.perf_counter() - start) / 60:.1f} min")
    train_minutes = (time.perf_counter() - start) / 60
    val = eval_loss(model, val_stream, args.batch, args.seq_len, batches=8)
    print(f"done: {args.steps} steps in {train_minutes:.1f} min, train loss {smoothed:.3f}, "
          f"held-out loss {val:.3f}")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # fp16 halves the folder (about 10 MB); minipaged and transformers upcast on load.
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2,
                     do_sample=False, max_new_tokens=64).save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>",
                            model_max_length=config.max_position_embeddings).save_pretrained(out)
    write_portable_tokenizer_class(out)
    cpu = platform.processor() or platform.machine()
    (out / "README.md").write_text(f"""# tiny-stdlib-llama

A {n_params / 1e6:.1f}M-parameter LLaMA (hidden 256, 4 layers, 8 query heads sharing
2 KV heads, vocabulary {tok.get_vocab_size()}, context {config.max_position_embeddings}) \
with a byte-level BPE
tokenizer, trained from scratch so that `python -m minipaged demo` prints real
(if naive) Python. It is a demo model: it knows the shape of Python code, not
what the code means.

- **Corpus**: the `*.py` source files of the Python {platform.python_version()} standard
  library (`sysconfig.get_paths()["stdlib"]`, without `test/` folders and
  `site-packages`): {len(texts)} files, {stream.numel() / 1e6:.2f} M tokens, each file
  wrapped as `<s> ... </s>`; the last 2% held out.
- **Corpus licence**: the Python Software Foundation License (PSF License
  Agreement), under which the CPython standard library is distributed.
- **Training command**: `python scripts/train_tiny_model.py --steps {args.steps}`
  (seed {args.seed}; fp32 weights with {args.dtype} autocast, on CPU with {args.threads}
  threads; AdamW, peak lr {args.lr:g}, warm-up then cosine; batch {args.batch} x
  {args.seq_len} tokens, {args.steps * args.batch * args.seq_len / 1e6:.1f} M tokens seen).
- **Training time**: {train_minutes:.1f} minutes on {platform.system()} {cpu}
  ({os.cpu_count()} CPUs visible), torch {torch.__version__}.
- **Final loss**: train {smoothed:.3f} (smoothed), held-out {val:.3f} (nats per token).
- **Weights**: stored in fp16.
""")
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
