"""From sampled tokens to what the user gets back: text, stop checks, outputs.

After the sampler has appended a token to each sequence that ran, this
module turns the token into text (incrementally, with the prompt as
context: ``detokenizer.py``), decides whether the sequence has ended (EOS,
a stop token, a stop string, ``max_tokens``, the model's context) and builds
the ``RequestOutput`` of each request.

Stop rules, as vLLM applies them: nothing but the length limits ends a
sequence before it has ``min_tokens`` tokens; then, in order, EOS (reason
None), a stop token id (reason: the id), a stop string (reason: the
string). When one step's text completes several stop strings, the first
in the ``stop`` list wins, not the one that starts earliest (vLLM's stop
checker loops over the list). The text of the token or string that stopped
the sequence is cut off unless ``include_stop_str_in_output``. A stop string
is looked for only where it could end inside the newest text, so checking
costs the same whatever the output length. A sequence that ends on length
gets the text its detokenizer still holds back (an incomplete character);
so does a beam-search hypothesis that ends on length.
"""

from __future__ import annotations

from typing import Any

from ..core.sequence import Sequence, SequenceGroup, SequenceStatus
from ..outputs import CompletionOutput, RequestOutput, SharedPrefix
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer, decoder_for


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The first of ``stops``, in list order, that ends within the last
    ``new_chars`` characters of ``text``, as ``(index where it starts, the
    string)``, else None.

    List order, not position, as in vLLM: with ``stop=["d", "world"]`` and
    new text ``"world"`` the answer is ``"d"``, though ``"world"`` starts
    earlier. Either way the cut is never before text already streamed: a
    string ending in the new text starts at most ``len(stop) - 1`` characters
    before it, and streaming holds back the last ``max(len) - 1``
    (``_completion``).
    """
    if new_chars <= 0:
        return None
    for stop in stops:
        # Only where the string would end inside the new text: one that ended
        # earlier was either found then or came before min_tokens.
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at != -1:
            return at, stop
    return None


_FLUSHED = (SequenceStatus.FINISHED_LENGTH_CAPPED, SequenceStatus.FINISHED_ABORTED,
            SequenceStatus.FINISHED_ERROR)
"""The ends ``flush_ended`` gives a sequence's held-back text to."""


class OutputProcessor:
    """Detokenizes, applies the stop rules and builds ``RequestOutput``s.

    Args:
        tokenizer: a Hugging Face tokenizer, or None (then text stays empty).
        eos_token_id: the tokenizer's (or model's) end-of-sequence token:
            it stops a sequence with ``stop_reason=None``.
        extra_eos_token_ids: further end tokens from the model's configs
            (Llama 3 lists several); they stop with their id as the reason.
        max_model_len: no sequence grows past this many tokens.
    """

    def __init__(self, tokenizer: Any, eos_token_id: int | None,
                 extra_eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = tuple(t for t in extra_eos_token_ids if t != eos_token_id)
        self.max_model_len = max_model_len
        self._decoders = {}
        if tokenizer is not None:
            self._decoders = {skip: decoder_for(tokenizer, skip) for skip in (True, False)}

    # -- which tokens stop ------------------------------------------------------
    def stop_token_ids(self, p: SamplingParams) -> tuple[int, ...]:
        """Tokens that end a sequence: ``stop_token_ids``, and EOS unless ``ignore_eos``."""
        eos = () if p.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        extra = () if p.ignore_eos else self.extra_eos_token_ids
        return tuple(p.stop_token_ids) + eos + extra

    def banned_token_ids(self, seq: Sequence, p: SamplingParams) -> tuple[int, ...]:
        """Stop tokens held back while the sequence is shorter than ``min_tokens``."""
        return self.stop_token_ids(p) if seq.num_output_tokens < p.min_tokens else ()

    def _stop_reason_of_token(self, token: int, p: SamplingParams) -> tuple[bool, int | None]:
        """(does ``token`` stop the sequence, the stop_reason it reports)."""
        if token in p.stop_token_ids:
            return True, token
        if p.ignore_eos:
            return False, None
        if token == self.eos_token_id:
            return True, None
        if token in self.extra_eos_token_ids:
            return True, token
        return False, None

    # -- sequences ------------------------------------------------------------
    def new_sequence(self, seq: Sequence, p: SamplingParams) -> None:
        """Give a new request's sequence its detokenizer (prompt as context)."""
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self._decoders[p.skip_special_tokens],
                                                     seq.prompt_token_ids)

    def process(self, appended: list[tuple[Sequence, SequenceGroup]]) -> None:
        """Each sequence just got one token: add its text, then (beams excepted:
        the beam search decides when they end) apply the stop rules.

        Runs once per sequence per step: the text is added only when there is
        some, and each sequence's last token and length are read once."""
        for seq, group in appended:
            new_chars = 0
            if seq.detokenizer is not None:
                new_text = seq.detokenizer.step(seq.output_token_ids[-1])
                if new_text:
                    # Held by this local alone, the text grows in place (CPython
                    # resizes a string nothing else refers to); `seq.output_text
                    # += new_text` would copy it whole, a cost that grows with it.
                    text, seq.output_text = seq.output_text, ""
                    text += new_text
                    seq.output_text = text
                    new_chars = len(new_text)
            if group.beam is None:
                self._check_stop(seq, new_chars, group.sampling_params)

    def _stop(self, text: str, new_chars: int, token: int, num_tokens: int,
              p: SamplingParams) -> tuple[str, int | str | None] | None:
        """Whether a sequence whose text is ``text`` (its last ``new_chars``
        characters new) stops at its ``num_tokens``-th token ``token``: if so,
        ``(its final text, stop_reason)``, else None."""
        if num_tokens < p.min_tokens:
            return None
        stops, reason = self._stop_reason_of_token(token, p)
        if stops:
            cut = new_chars and not p.include_stop_str_in_output
            return (text[:-new_chars] if cut else text), reason
        hit = find_stop_string(text, new_chars, p.stop_strings)
        if hit is None:
            return None
        at, stop = hit
        return text[:at + (len(stop) if p.include_stop_str_in_output else 0)], stop

    def _check_stop(self, seq: Sequence, new_chars: int, p: SamplingParams) -> None:
        token, num_tokens = seq.output_token_ids[-1], len(seq.output_token_ids)
        stopped = self._stop(seq.output_text, new_chars, token, num_tokens, p)
        if stopped is not None:
            seq.output_text, seq.stop_reason = stopped
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif seq.matcher is not None and seq.matcher.is_terminated():
            seq.status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete
        elif num_tokens >= p.max_tokens or seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            if seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()

    @staticmethod
    def flush_ended(group: SequenceGroup) -> None:
        """A group the scheduler ended for capacity (length, or an abort when the
        swap pool is full), or the engine for an error in its inputs, gets the
        text its detokenizers still hold back, as a sequence ending on
        ``max_tokens`` does. Flushing twice adds nothing, and a sequence that
        stopped on a stop rule is left as it was cut."""
        for seq in group.get_seqs():
            if seq.detokenizer is not None and seq.status in _FLUSHED:
                seq.output_text += seq.detokenizer.flush()

    # -- beam search ------------------------------------------------------------
    @staticmethod
    def _peek(parent: Sequence, token: int, flush: bool = False) -> str:
        """The text ``token`` would add to ``parent`` (``flush``: with what the
        detokenizer would still hold back, an incomplete character)."""
        return parent.detokenizer.peek(token, flush) if parent.detokenizer else ""

    def _beam_tail(self, parent: Sequence, token: int, p: SamplingParams) -> tuple[str, str]:
        """(end of the parent's text long enough to hold a stop string, new text)."""
        new_text = self._peek(parent, token)
        keep = p.stop_hold_back
        return (parent.output_text[-keep:] if keep else ""), new_text

    def beam_ends_by_stop_string(self, parent: Sequence, token: int, p: SamplingParams) -> bool:
        """Would ``parent`` + ``token`` complete a stop string?"""
        tail, new_text = self._beam_tail(parent, token, p)
        return find_stop_string(tail + new_text, len(new_text), p.stop_strings) is not None

    def finish_hypothesis(self, hyp: Any, parent: Sequence, p: SamplingParams) -> None:
        """Fill in a finished beam's text, ``finish_reason`` and ``stop_reason``.

        ``hyp`` (a ``beam_search.Hypothesis``) ends with one token more than
        ``parent``, the beam it continues. One that ends on length gets the
        text its detokenizer holds back, as a plain sequence does in
        ``_check_stop``: else a last incomplete character would be lost.
        """
        token = hyp.token_ids[-1]
        new_text = self._peek(parent, token)
        stopped = self._stop(parent.output_text + new_text, len(new_text), token,
                             len(hyp.token_ids), p)
        if stopped is not None:
            (hyp.text, hyp.stop_reason), hyp.finish_reason = stopped, "stop"
        else:
            hyp.text = parent.output_text + self._peek(parent, token, flush=True)
            hyp.stop_reason, hyp.finish_reason = None, "length"

    # -- outputs --------------------------------------------------------------
    def request_output(self, group: SequenceGroup, delta: bool = False) -> RequestOutput:
        """The request's outputs so far (all of them once it has finished).

        ``delta``: only the tokens, logprobs and text added since the last
        delta output of each sequence (``cumulative_logprob`` stays the total),
        so that streaming costs what a step adds, not what a sequence holds.
        A beam search has no stable beams to stream: its delta output is the
        final one, once it is done.
        """
        p = group.sampling_params
        finished = group.is_finished()
        beam = group.beam
        if beam is not None and beam.done:
            want_logprobs = p.logprobs is not None
            outputs = [CompletionOutput(
                index=i, text=h.text, token_ids=list(h.token_ids),
                cumulative_logprob=h.cumulative_logprob if want_logprobs else None,
                logprobs=list(h.logprobs) if want_logprobs else None,
                finish_reason=h.finish_reason, stop_reason=h.stop_reason)
                for i, h in enumerate(beam.best(p.n))]
        elif beam is not None and delta:
            outputs = []
        elif len(group.seqs) == 1:   # the usual request (asked for once per step)
            outputs = [self._completion(0, next(iter(group.seqs.values())), p, delta)]
        else:
            seqs = sorted(group.seqs.values(), key=lambda s: s.seq_id)
            if finished and len(seqs) > p.n:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[:p.n]
            outputs = [self._completion(i, s, p, delta) for i, s in enumerate(seqs)]
        prompt_ids = group.prompt_token_ids
        if not finished and group.prompt_view is None:
            group.prompt_view = SharedPrefix(prompt_ids)
        return RequestOutput(group.request_id, group.prompt,
                             list(prompt_ids) if finished else group.prompt_view,
                             outputs, finished, group.metrics, group.num_cached_tokens,
                             self._prompt_logprobs(group, delta))

    @staticmethod
    def _prompt_logprobs(group: SequenceGroup, delta: bool) -> list | SharedPrefix | None:
        """The request's prompt logprobs (None unless asked for): those added
        since the last delta output, else all so far (read in place while the
        request runs: the list only grows, and its entries are final)."""
        entries = group.prompt_logprobs
        if entries is None:
            return None
        if delta:
            new = entries[group.sent_prompt_logprobs:]
            group.sent_prompt_logprobs = len(entries)
            return new
        return list(entries) if group.is_finished() else SharedPrefix(entries)

    @staticmethod
    def _completion(index: int, s: Sequence, p: SamplingParams, delta: bool) -> CompletionOutput:
        want_logprobs = p.logprobs is not None
        status = s.status
        ended = status.is_finished
        text = s.output_text
        if not delta:
            if ended:
                token_ids, logprobs = list(s.output_token_ids), list(s.output_logprobs)
            else:  # so far, read in place: a copy would grow with the sequence
                token_ids = SharedPrefix(s.output_token_ids)
                logprobs = SharedPrefix(s.output_logprobs) if want_logprobs else None
        else:
            tokens, chars, end = s.sent_tokens, s.sent_chars, len(text)
            if not ended and p.stop_strings and not p.include_stop_str_in_output:
                # Hold back what could be the start of a stop string: it would be
                # cut from the text if the string completes.
                end = max(chars, end - p.stop_hold_back)
            s.sent_tokens, s.sent_chars = len(s.output_token_ids), end
            token_ids, logprobs = s.output_token_ids[tokens:], s.output_logprobs[tokens:]
            text = text[chars:end]
        return CompletionOutput(index, text, token_ids,
                                s.cumulative_logprob if want_logprobs else None,
                                logprobs if want_logprobs else None,
                                status.finish_reason if ended else None, s.stop_reason)
