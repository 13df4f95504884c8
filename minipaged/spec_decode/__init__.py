"""Speculative decoding: guess a sequence's next tokens cheaply, let the model
check all the guesses in one pass, keep the ones it agrees with.

- ``ngram``: the prompt-lookup proposer (``NgramProposer``);
- ``draft_model``: a smaller model as proposer, on a paged KV pool of its own
  (``DraftModel``, and ``DraftSequence``, each sequence's view in it);
- ``truncate``: a draft made of a model's own first layers;
- ``acceptance``: the acceptance rules, greedy and rejection sampling;
- ``decoder``: the engine's part of a step (``SpeculativeDecoder``): proposing,
  verifying the scored drafts, and the statistics (``SpecDecodeStats``).

The scheduler gives drafts their slots and rolls rejected ones back
(``core.scheduler``); the model runner feeds them (``executor.model_runner``).
"""
