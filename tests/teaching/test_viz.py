"""Pictures of the memory manager: what is drawn matches the pools' state."""

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import same_color  # noqa: E402

from minipaged import BlockSpaceManager, Sequence, SequenceGroup, SequenceStatus  # noqa: E402
from minipaged.teaching.viz import (  # noqa: E402
    FREE_COLOR,
    SHARED_HATCH,
    draw_block_pool,
    draw_block_tables,
    draw_memory,
    request_of,
)

BS = 16


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _forked(prompt_len=37, n=3, device=24, cpu=8):
    """One request with ``n`` sequences sharing a ``prompt_len``-token prompt,
    plus a second one-sequence request."""
    m = BlockSpaceManager(BS, device, cpu)
    parent = Sequence(0, range(prompt_len), BS)
    group = SequenceGroup("A", [parent])
    m.allocate(group)
    parent.status = SequenceStatus.RUNNING
    for i in range(1, n):
        child = parent.fork(i)
        group.add(child)
        m.fork(parent, child)
    other = Sequence(10, range(20), BS)
    group_b = SequenceGroup("B", [other])
    m.allocate(group_b)
    return m, group, group_b


def _patches(ax, pool):
    return {int(p.get_gid().split("-")[1]): p for p in ax.patches
            if (p.get_gid() or "").startswith(pool + "-")}


def _refcount_texts(ax, pool):
    return {int(t.get_gid().rsplit("-", 1)[1]): t.get_text() for t in ax.texts
            if (t.get_gid() or "").startswith(f"refcount-{pool}-")}


def _check_pool_picture(m, ax):
    for name, pool in (("device", m.device_pool), ("cpu", m.cpu_pool)):
        squares = _patches(ax, name)
        assert sorted(squares) == list(range(pool.num_total))
        free = [b for b, p in squares.items() if same_color(p.get_facecolor(), FREE_COLOR)]
        assert len(free) == pool.num_free
        assert sorted(free) == sorted(pool.free_blocks())
        shared = {b for b in range(pool.num_total) if pool.refcount(b) > 1}
        assert {b for b, p in squares.items() if p.get_hatch() == SHARED_HATCH} == shared
        assert _refcount_texts(ax, name) == {b: f"x{pool.refcount(b)}" for b in shared}


def test_pool_after_fork_marks_shared_blocks_with_their_refcount():
    m, group, group_b = _forked()
    ax = draw_block_pool(m, labels=[group, group_b])
    _check_pool_picture(m, ax)
    assert _refcount_texts(ax, "device") == {0: "x3", 1: "x3", 2: "x3"}
    free = [p for p in ax.patches if same_color(p.get_facecolor(), FREE_COLOR)]
    assert len(free) == m.device_pool.num_free + m.cpu_pool.num_free == 24 - 5 + 8


def test_pool_after_copy_on_write_and_swap_out():
    m, group, group_b = _forked()
    expected = [{0: "x3", 1: "x3", 2: "x2"}, {0: "x3", 1: "x3"}, {0: "x3", 1: "x3"}]
    for s, want in zip(group.get_seqs(), expected):
        s.append_token(7)
        m.append_slots(s)
        ax = draw_block_pool(m, labels=[group, group_b])
        _check_pool_picture(m, ax)
        assert _refcount_texts(ax, "device") == want
    squares = _patches(ax, "device")
    owned = [s.block_table.blocks[-1] for s in group.get_seqs()]   # one copy each
    colours = [tuple(squares[b].get_facecolor()) for b in owned]
    assert len(set(colours)) == 3 and not any(same_color(c, FREE_COLOR) for c in colours)
    m.swap_out(group)
    ax = draw_block_pool(m, labels=[group, group_b])
    _check_pool_picture(m, ax)
    assert _refcount_texts(ax, "cpu") == {0: "x3", 1: "x3"}


def test_pool_without_cpu_row():
    m, group, _ = _forked()
    ax = draw_block_pool(m, show_cpu=False)
    assert not _patches(ax, "cpu")
    assert len(_patches(ax, "device")) == m.device_pool.num_total


def test_request_labels_from_groups_and_mapping():
    m, group, group_b = _forked()
    assert request_of(m.sequences(), [group, group_b]) == {0: "A", 1: "A", 2: "A", 10: "B"}
    assert request_of(m.sequences(), {10: "b"}) == {10: "b", 0: "seq 0", 1: "seq 1", 2: "seq 2"}


def test_block_tables_show_ids_and_fill_levels():
    m, group, _ = _forked(prompt_len=37, n=2)
    seqs = group.get_seqs()
    ax = draw_block_tables(seqs, manager=m)
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("16/16") == 4 and texts.count("5/16") == 2
    assert texts.count("0") == 2 and texts.count("2") == 2        # physical ids, once per row
    hatched = [p for p in ax.patches if p.get_hatch() == SHARED_HATCH]
    assert len(hatched) == 6                                       # all 3 blocks, both rows


def test_draw_memory_has_pool_and_tables():
    m, group, group_b = _forked()
    fig = draw_memory(m, labels=[group, group_b], title="t")
    assert len(fig.axes) == 2
    assert fig.axes[0].get_title() == "t"
