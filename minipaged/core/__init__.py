"""Memory and scheduling: the paper's block tables, allocator, block manager
and scheduler, and the sequences they manage.

Owns: which blocks each sequence holds (``block_table``, ``allocator``,
``block_manager``: reference counts, copy-on-write, prefix caching, the CPU
swap pool) and which sequences run each step (``scheduler``, which builds and
owns the block manager). Knows nothing of models, tensors on a device, or HTTP.

May import: ``minipaged.config`` and the standard library. Nothing above it
(the executor, models, kernels, sampling, the engine or the server).
"""
