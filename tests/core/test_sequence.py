import pytest

from minipaged.core.sequence import Sequence, SequenceGroup, SequenceStatus


def test_append_and_lengths():
    s = Sequence(0, [5, 6, 7], block_size=16)
    s.append_token(9, logprob=-0.5)
    s.append_token(3, logprob=-1.0)
    assert s.token_ids == [5, 6, 7, 9, 3]
    assert s.get_len() == 5 and s.num_prompt_tokens == 3 and s.num_output_tokens == 2
    assert s.last_token_id == 3
    assert s.cumulative_logprob == pytest.approx(-1.5)
    assert s.num_uncomputed_tokens == 5


def test_fork_copies_tokens_not_blocks():
    s = Sequence(0, [1, 2], block_size=4)
    s.append_token(3, -0.1)
    s.block_table.blocks = [4]
    c = s.fork(1)
    c.append_token(8)
    assert s.token_ids == [1, 2, 3] and c.token_ids == [1, 2, 3, 8]
    assert c.block_table.blocks == [] and c.seq_id == 1


def test_statuses_and_finish_reasons():
    assert not SequenceStatus.RUNNING.is_finished
    assert SequenceStatus.FINISHED_ABORTED.is_finished
    assert SequenceStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert SequenceStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert SequenceStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert SequenceStatus.SWAPPED.finish_reason is None


def test_group_queries():
    a, b = Sequence(0, [1], 4), Sequence(1, [1], 4)
    g = SequenceGroup("r", [a, b], arrival_time=1.0)
    b.status = SequenceStatus.FINISHED_STOPPED
    assert g.get_seqs(SequenceStatus.WAITING) == [a]
    assert g.get_unfinished_seqs() == [a] and not g.is_finished()
    a.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    assert g.is_finished()
    with pytest.raises(ValueError):
        g.add(Sequence(0, [1], 4))
    with pytest.raises(ValueError):
        SequenceGroup("empty", [])


def test_reset_for_recompute():
    s = Sequence(0, [1, 2], 4)
    s.status = SequenceStatus.RUNNING
    s.num_computed_tokens = 2
    s.append_token(5)
    s.reset_for_recompute()
    assert s.status == SequenceStatus.WAITING and s.num_computed_tokens == 0
    assert s.token_ids == [1, 2, 5]


def test_token_ids_between_equals_a_slice():
    seq = Sequence(0, [10, 11, 12], block_size=4)
    for t in (20, 21, 22, 23):
        seq.append_token(t)
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_ids_between(start, end) == seq.token_ids[start:end]


def test_max_num_running_seqs_counts_forks_ahead():
    from minipaged import SamplingParams
    seq = Sequence(0, [1, 2], block_size=4)
    group = SequenceGroup("r", [seq], SamplingParams(n=2, best_of=3, temperature=1.0))
    assert group.max_num_running_seqs() == 3            # not forked yet: counts best_of
    seq.append_token(5)
    assert group.max_num_running_seqs() == 1            # forked (here: into itself only)
    seq.status = SequenceStatus.FINISHED_STOPPED
    assert group.max_num_running_seqs() == 0
