"""Pictures of the memory manager, for the book and for debugging.

``draw_block_pool`` draws the physical pools of a ``BlockSpaceManager``, one
square per block id; ``draw_block_tables`` draws each sequence's logical
blocks and the physical ids they point to; ``draw_memory`` puts both in one
figure. Colours follow requests: the sequences of one ``SequenceGroup`` share a
colour family (blues, oranges, ...), one shade per sequence. matplotlib is only
a dev dependency, so it is imported inside the functions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from ..core.block_table import Location, blocks_for_tokens
from ..core.sequence import Sequence, SequenceGroup

FREE_COLOR = "#e6e6e6"      # a free block
SHARED_HATCH = "//"         # a block with reference count > 1
_FAMILIES = ["Blues", "Oranges", "Greens", "Purples", "Reds", "YlOrBr"]

Labels = Mapping[int, str] | Iterable[SequenceGroup] | None


def request_of(seqs: Iterable[Sequence], labels: Labels = None) -> dict[int, str]:
    """``seq_id -> request label``, in colour order.

    ``labels`` is either a mapping ``seq_id -> request id`` or a list of
    ``SequenceGroup``s (their sequences are labelled with the group's
    ``request_id``). A sequence found in neither is its own request.
    """
    if labels is None:
        out: dict[int, str] = {}
    elif isinstance(labels, Mapping):
        out = {int(k): str(v) for k, v in labels.items()}
    else:
        out = {sid: g.request_id for g in labels for sid in g.seqs}
    for s in seqs:
        out.setdefault(s.seq_id, f"seq {s.seq_id}")
    return out


def _palette(req: dict[int, str]) -> tuple[dict[int, tuple], dict[str, tuple]]:
    """Colour per sequence (a shade of its request's family) and per request."""
    import matplotlib

    families = list(dict.fromkeys(req.values()))   # requests in order of first sequence
    rank: dict[str, int] = defaultdict(int)
    seq_colour, req_colour = {}, {}
    for sid, r in req.items():
        cmap = matplotlib.colormaps[_FAMILIES[families.index(r) % len(_FAMILIES)]]
        seq_colour[sid], req_colour[r] = cmap(max(0.3, 0.7 - 0.15 * rank[r])), cmap(0.9)
        rank[r] += 1
    return seq_colour, req_colour


def _dark(colour) -> bool:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return 0.3 * r + 0.6 * g + 0.1 * b < 0.55


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    ax.set_aspect("equal")
    ax.set_anchor("W")
    ax.axis("off")
    return ax


def _draw_block(ax, x: float, y: float, gid: str, block: int, refcount: int, face,
                hatch: str | None) -> None:
    """One block's square at ``(x, y)``: its id in the corner, and its count
    (``x3``) when several tables hold it."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=face, hatch=hatch,
                           edgecolor="0.2" if hatch else "none", linewidth=0.6, gid=gid))
    ax.text(x + 0.1, y + 0.88, str(block), fontsize=5, va="top",
            color="white" if _dark(face) else "0.3")
    if refcount > 1:
        ax.text(x + 0.5, y + 0.42, f"x{refcount}", ha="center", va="center", fontsize=8,
                weight="bold", gid=f"refcount-{gid}",
                bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))


def draw_block_pool(manager, ax=None, title=None, labels: Labels = None, ncols: int = 16,
                    show_cpu: bool = True):
    """Draw the device pool (and below it the CPU swap pool) of ``manager``.

    One square per physical block id, ``ncols`` per row, id written small in
    the corner. A held block takes the colour of the sequence holding it; a
    block held by several tables (reference count > 1) is hatched, takes the
    darker colour of its request and shows its count (``x3``); a free block is
    light grey (``FREE_COLOR``). Owners come from ``manager.sequences()`` and
    each table's ``location``; ``labels`` names their requests (see
    ``request_of``). Patches and texts carry gids ``"<pool>-<id>"`` and
    ``"refcount-<pool>-<id>"``. Returns the axes.
    """
    from matplotlib.patches import Patch

    seqs = manager.sequences()
    req = request_of(seqs, labels)
    seq_colour, req_colour = _palette(req)
    pools = [(Location.DEVICE, manager.device_pool)]
    if show_cpu and manager.cpu_pool.num_total:
        pools.append((Location.CPU, manager.cpu_pool))
    rows = sum(blocks_for_tokens(p.num_total, ncols) for _, p in pools)
    ax = _axes(ax, (0.45 * ncols + 3, 0.5 * rows + 1.2))
    top = 0.0
    for loc, pool in pools:
        holders: dict[int, list[Sequence]] = defaultdict(list)
        for s in seqs:
            if s.block_table.location == loc:
                for b in s.block_table.blocks:
                    holders[b].append(s)
        ax.text(-0.3, top - 0.5, f"{loc.value}\n{pool.num_used}/{pool.num_total} used",
                ha="right", va="center", fontsize=8)
        for b in range(pool.num_total):
            r, c = divmod(b, ncols)
            owners, rc = holders.get(b, []), pool.refcount(b)
            if rc == 0:
                face, hatch = FREE_COLOR, None
            elif rc > 1:
                face, hatch = req_colour[req[owners[0].seq_id]] if owners else "0.4", SHARED_HATCH
            else:
                face, hatch = seq_colour[owners[0].seq_id] if owners else "0.4", None
            _draw_block(ax, c, top - r - 1, f"{loc.value}-{b}", b, rc, face, hatch)
        top -= blocks_for_tokens(pool.num_total, ncols) + 0.4
    ax.set_xlim(-0.1, ncols + 0.1)
    ax.set_ylim(top - 0.1, 0.1)
    held = {s.seq_id for s in seqs}
    handles = [Patch(facecolor=seq_colour[sid], label=f"{req[sid]} / seq {sid}")
               for sid in req if sid in held]
    handles += [Patch(facecolor="0.6", hatch=SHARED_HATCH, edgecolor="0.2", label="shared"),
                Patch(facecolor=FREE_COLOR, label="free")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_block_tables(seqs: Iterable[Sequence], ax=None, labels: Labels = None, manager=None,
                      title=None):
    """Draw each sequence's block table: one row per sequence, one square per
    logical block, with the physical id inside and the square filled from the
    bottom in proportion to the tokens it holds (``n/block_size`` below it).

    Rows are labelled ``request / seq id`` and the pool (``device``/``cpu``).
    With ``manager``, blocks whose reference count is > 1 are hatched.
    Returns the axes.
    """
    from matplotlib.patches import Rectangle

    seqs = list(seqs)
    req = request_of(seqs, labels)
    seq_colour, _ = _palette(req)
    width = max([s.block_table.num_blocks for s in seqs] + [1])
    ax = _axes(ax, (0.6 * width + 3, 0.7 * len(seqs) + 0.8))
    for row, s in enumerate(seqs):
        t, y = s.block_table, -1.3 * (row + 1)
        ax.text(-0.3, y + 0.5, f"{req[s.seq_id]} / seq {s.seq_id}\n({t.location.value})",
                ha="right", va="center", fontsize=8)
        pool = None if manager is None else (
            manager.device_pool if t.location == Location.DEVICE else manager.cpu_pool)
        for i, b in enumerate(t.blocks):
            filled = min(t.block_size, max(0, t.num_tokens - i * t.block_size))
            shared = pool is not None and pool.refcount(b) > 1
            ax.add_patch(Rectangle((i + 0.05, y), 0.9, 0.9, facecolor="white",
                                   edgecolor="0.2", linewidth=0.8,
                                   hatch=SHARED_HATCH if shared else None))
            ax.add_patch(Rectangle((i + 0.05, y), 0.9, 0.9 * filled / t.block_size,
                                   facecolor=seq_colour[s.seq_id], alpha=0.85))
            ax.text(i + 0.5, y + 0.45, str(b), ha="center", va="center", fontsize=9,
                    weight="bold")
            ax.text(i + 0.5, y - 0.12, f"{filled}/{t.block_size}", ha="center", va="top",
                    fontsize=6, color="0.3")
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-1.3 * len(seqs) - 0.4, 0.0)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_memory(manager, labels: Labels = None, title=None, ncols: int = 16):
    """One figure: the pools (top) and the block tables of every sequence that
    holds blocks (bottom). Returns the figure."""
    import matplotlib.pyplot as plt

    seqs = sorted(manager.sequences(), key=lambda s: s.seq_id)
    pool_rows = sum(blocks_for_tokens(p.num_total, ncols) + 0.4
                    for p in (manager.device_pool, manager.cpu_pool) if p.num_total)
    table_rows = 1.3 * max(len(seqs), 1) + 0.4
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(0.4 * ncols + 3.5, 0.4 * (pool_rows + table_rows) + 0.8),
        gridspec_kw={"height_ratios": [pool_rows, table_rows]})
    draw_block_pool(manager, ax=top, labels=labels, ncols=ncols, title=title)
    draw_block_tables(seqs, ax=bottom, labels=labels, manager=manager)
    bottom.set_xlim(top.get_xlim())      # same scale: one square is one block
    return fig
