"""Workloads and the benchmarks of minipaged's own parts.

Each benchmark runs as ``python -m minipaged.bench.NAME`` and writes its JSON
(and a PNG when matplotlib is installed) under ``assets/`` by default.

What stays in the package, and why: the book, the demo or the tests import
it, or it measures this package through its own API in this interpreter.

- ``workloads``, ``chat_prompts``: the synthetic traces and real chat
  requests every benchmark and several chapters serve.
- ``memory_waste``: the paper's memory-waste comparison (chapters 00 and 08).
- ``serving``: normalized latency against request rate (chapter 08);
  ``serving_classes`` (``serving --classes``): per-class latency of a mixed
  workload under FCFS and priority scheduling; ``decodes_first``: chats'
  time per output token beside long chunked prompts, run against two commits.
- ``throughput`` (with ``_throughput_workers`` and ``_throughput_common``):
  minipaged against transformers and vLLM on the same requests (the README).
- ``kernels``, ``cuda_graphs``, ``host_overhead`` (with ``stand_ins``),
  ``prefix``, ``timing``: the kernels, CUDA graphs, one engine step and the
  prefix cache, each timed through the package's API; chapter 02 reads the
  kernel benchmark's summary.
- ``parallel_check``: tensor and pipeline parallelism launched by
  ``torchrun`` on however many GPUs there are, against one process (NCCL
  runs only on a GPU machine).
- ``gpu_check`` (with ``gpu_steps``, what each step runs): the one command a
  lent GPU runs, under the name the README gives; each step, in a process
  of its own, drives the benchmarks above through their ``main``.

What reaches outside the package lives in the repository's ``scripts/``
(not installed; see ``scripts/README.md``): the vLLM worker, run by vLLM's
own interpreter; the kernel resource report, which drives the CUDA
compiler bundled with Triton; and the drivers of the paper's sweeps.
"""
