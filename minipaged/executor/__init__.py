"""Execution: running one scheduled step on the model and the KV pools.

Owns: the executor (local, or a driver with tensor/pipeline-parallel workers:
start-up, shutdown, pool sizing, kernel warm-up and CUDA graphs), the model
runner (a ``SchedulerOutput`` -> input tensors -> logits), the cache engine
(the KV tensors, swapping and copying blocks) and the decode CUDA graphs.
``driver`` and ``worker`` are the two halves of the distributed executor
(the driver broadcasts each step; a worker runs its rank's part); they live
here because they drive the runner and the cache engine, while
``minipaged.distributed`` keeps only what models and executor share (process
groups, the torchrun launch, the pipeline's layer split).

May import: ``core``, ``models``, ``kernels``, ``distributed``, ``config``,
``sampling_params``. Not the engine, sampling of tokens, or the server.
"""
