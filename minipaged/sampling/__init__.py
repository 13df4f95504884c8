"""Sampling: logits -> next tokens, and the bookkeeping that follows them.

Owns: the sampler (temperature, top-k/p, min-p, seeds), penalties and logit
bias, structured output (grammar masks), prompt logprobs, beam search, and
the group processor that appends each sampled token to its sequence and
forks parallel samples and beams (the block work of a fork is the
scheduler's: the processor asks it).

May import: ``core``, ``postprocess``, ``sampling_params``, ``config``.
Not the executor, models, kernels, the engine or the server.
"""
