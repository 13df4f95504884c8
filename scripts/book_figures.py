"""Draw three teaching figures of minipaged, sized for slides, into ``assets/``.

1. ``paged_mapping``: two requests' logical KV blocks, their block tables
   (logical block -> physical block, filled slots) and the physical blocks they
   land on, scattered over the GPU pool (block size 4, the paper's section 4.2).
2. ``copy_on_write``: two sampled sequences share a prompt's blocks
   (reference count 2); the first to write into the shared, partly filled last
   block gets a copy, the other then holds the original alone and writes in place
   (``BlockAllocator.write_target``, ``BlockSpaceManager.append_slots``).
3. ``engine_step``: the six stages of one ``LLMEngine.step``, as a cycle, each
   with the module that does it (the engine only wires them together).

Every figure is drawn for a projector: labels of 16 pt or more, thick lines and
the Okabe-Ito colour-blind-safe palette. Each is written as PNG and SVG.

It lives in ``scripts/`` because it makes pictures for slides and the book and is
no part of the package: it imports nothing from ``minipaged``. What it draws
(who copies on write, the reference counts, the order of the stages and who does
each) follows ``core/allocator.py``, ``core/block_manager.py``, ``core/scheduler.py``
and ``LLMEngine.step``;
the block ids are picked to look scattered, as in a pool that has served a while.

    python scripts/book_figures.py [--out assets]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

# Okabe-Ito, a palette that reads the same under the common colour-vision deficiencies.
BLUE, ORANGE, GREEN, VERMILION = "#0072B2", "#E69F00", "#009E73", "#D55E00"
PURPLE, SKY, GREY, INK = "#CC79A7", "#56B4E9", "#BBBBBB", "#222222"
LIGHT = {BLUE: "#CFE3F1", ORANGE: "#FBE8C2", GREEN: "#C7EADF", VERMILION: "#F6D5C0",
         PURPLE: "#F2DDE9", GREY: "#F2F2F2"}
TOKEN, LABEL, TITLE = 17, 19, 24      # font sizes in points
LINE = 2.5                            # line width in points
BLOCK_SIZE = 4
STYLE = {"font.size": LABEL, "font.family": "DejaVu Sans", "svg.hashsalt": "minipaged"}
FIGSIZE = (16, 9)                     # inches, a 16:9 slide; axes units are inches


def _canvas() -> tuple[Figure, Axes]:
    """A 16 x 9 inch figure whose single axes measures in inches, no ticks (a bare
    ``Figure``, not pyplot: importing this module changes no backend)."""
    fig = Figure(figsize=FIGSIZE)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, FIGSIZE[0])
    ax.set_ylim(0, FIGSIZE[1])
    ax.set_axis_off()
    return fig, ax


def _block(ax, x, y, tokens, color, cell=1.15, height=0.62, hot=None):
    """A KV block of ``BLOCK_SIZE`` slots, left edge ``x``, centre height ``y``.
    ``tokens`` fill the first slots (empty ones are dashed); ``hot`` is the index of
    a slot to highlight. Returns the right edge."""
    for i in range(BLOCK_SIZE):
        filled = i < len(tokens)
        face = LIGHT[color] if filled else "white"
        if i == hot:
            face = color
        ax.add_patch(Rectangle((x + i * cell, y - height / 2), cell, height, facecolor=face,
                               edgecolor=INK if filled else GREY, lw=LINE,
                               linestyle="-" if filled else "--"))
        if filled:
            ax.text(x + (i + 0.5) * cell, y, tokens[i], ha="center", va="center",
                    fontsize=TOKEN, color="white" if i == hot else INK,
                    fontweight="bold" if i == hot else "normal")
    return x + BLOCK_SIZE * cell


def _arrow(ax, start, end, color, rad=0.0, lw=LINE + 0.5):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=22, lw=lw,
                                 color=color, connectionstyle=f"arc3,rad={rad}",
                                 shrinkA=2, shrinkB=4))


def _chunks(words: list[str]) -> list[list[str]]:
    return [words[i:i + BLOCK_SIZE] for i in range(0, len(words), BLOCK_SIZE)]


# -- figure 1: logical -> physical ---------------------------------------------------------
REQUESTS = {  # name: (words so far, physical block of each logical block, colour)
    "A": ("Four score and seven years ago our fathers brought forth".split(), [6, 1, 4], BLUE),
    "B": ("It was the best of times, it was the worst of times".split(), [3, 7, 0], VERMILION),
}
NUM_PHYSICAL = 8


def _block_table(ax, x, rows, physical, chunks, color):
    """Columns logical | physical | # filled; row ``i`` at height ``rows[i]``.
    Returns the right edge's x, where the arrows to the physical blocks start."""
    widths, h = (1.25, 1.3, 1.3), 0.62
    top = rows[0] + h / 2
    for j, head in enumerate(("logical", "physical", "# filled")):
        ax.text(x + sum(widths[:j]) + widths[j] / 2, top + 0.28, head, ha="center",
                va="center", fontsize=16, color=INK)
    for i, y in enumerate(rows):
        values = (str(i), str(physical[i]), f"{len(chunks[i])}/{BLOCK_SIZE}")
        for j, value in enumerate(values):
            left = x + sum(widths[:j])
            ax.add_patch(Rectangle((left, y - h / 2), widths[j], h, facecolor="white",
                                   edgecolor=INK, lw=LINE))
            ax.text(left + widths[j] / 2, y, value, ha="center", va="center", fontsize=LABEL,
                    color=color if j == 1 else INK, fontweight="bold" if j == 1 else "normal")
    return x + sum(widths)


def draw_paged_mapping(path: Path) -> None:
    """Figure 1: each request's logical blocks, its block table, the scattered physical blocks."""
    with rc_context(STYLE):
        fig, ax = _canvas()
        heads = ((2.6, "Logical KV blocks"), (7.45, "Block tables"),
                 (13.0, "Physical KV blocks (GPU)"))
        for x, text in heads:
            ax.text(x, 8.55, text, ha="center", va="center", fontsize=TITLE, fontweight="bold")
        phys_y = {b: 7.45 - 0.85 * b for b in range(NUM_PHYSICAL)}
        owner = {}
        for k, (name, (words, physical, color)) in enumerate(REQUESTS.items()):
            chunks = _chunks(words)
            rows = [6.7 - 3.3 * k - 0.78 * i for i in range(len(chunks))]
            ax.text(0.3, rows[0] + 0.62, f"Request {name}", fontsize=LABEL + 1,
                    fontweight="bold", color=color, va="center")
            for i, (y, chunk) in enumerate(zip(rows, chunks)):
                ax.text(0.35, y, str(i), ha="center", va="center", fontsize=16, color=INK)
                _block(ax, 0.6, y, chunk, color, cell=1.12)
            right = _block_table(ax, 5.7, rows, physical, chunks, color)
            for i, (y, chunk) in enumerate(zip(rows, chunks)):
                owner[physical[i]] = (chunk, color)
                _arrow(ax, (right, y), (10.55, phys_y[physical[i]]), color)
        for b, y in phys_y.items():
            chunk, color = owner.get(b, ([], GREY))
            end = _block(ax, 10.6, y, chunk, color, cell=1.12)
            ax.text(end + 0.15, y, str(b), va="center", fontsize=LABEL, fontweight="bold")
        ax.text(13.0, 0.55, "block size 4 tokens;  dashed = empty slot", ha="center",
                va="center", fontsize=16, color="#555555")
        _save(fig, path)


# -- figure 2: copy-on-write ----------------------------------------------------------------
PROMPT = "The cat sat on the mat and".split()
SAMPLES = ("slept", "purred")             # the next token of seq 1 and seq 2
SEQ_COLORS = (BLUE, VERMILION)


def _cow_panel(ax, y0, after: bool) -> None:
    """One panel, bottom at ``y0``: the two block tables, three physical blocks
    (7, 1, 3) and their reference counts, before or after seq 1 writes."""
    title = ("After: seq 1 writes into a copy (block 3), seq 2 in place" if after
             else "Before: seq 1 and seq 2 share blocks 7 and 1")
    ax.text(0.3, y0 + 3.75, title, fontsize=TITLE - 2, fontweight="bold", va="center")
    tables = ([7, 3], [7, 1]) if after else ([7, 1], [7, 1])
    block_y = {7: y0 + 2.65, 1: y0 + 1.6, 3: y0 + 0.55}
    first, last = PROMPT[:BLOCK_SIZE], PROMPT[BLOCK_SIZE:]
    contents = {7: (first, PURPLE, None), 1: (last, PURPLE, None)}
    if after:
        contents[1] = (last + [SAMPLES[1]], VERMILION, 3)
        contents[3] = (last + [SAMPLES[0]], BLUE, 3)
    refs = {7: 2, 1: 1 if after else 2, 3: 1 if after else 0}
    for s, (table, color) in enumerate(zip(tables, SEQ_COLORS)):
        _cow_table(ax, y0 + 2.45 - 1.35 * s, s, table, color, block_y, after)
    for b, y in block_y.items():
        tokens, color, hot = contents.get(b, ([], GREY, None))
        end = _block(ax, 6.5, y, tokens, color, cell=1.05, hot=hot)
        ax.text(end + 0.85, y, f"block {b}", va="center", fontsize=LABEL)
        ref_color = {2: PURPLE, 1: GREEN, 0: GREY}[refs[b]]
        ax.add_patch(FancyBboxPatch((13.3, y - 0.27), 1.9, 0.54, boxstyle="round,pad=0.05",
                                    facecolor=LIGHT[ref_color], edgecolor=ref_color, lw=LINE))
        ax.text(14.25, y, f"ref = {refs[b]}" if refs[b] else "free", ha="center",
                va="center", fontsize=LABEL, fontweight="bold")
    if after:
        x = 6.5 + BLOCK_SIZE * 1.05
        _arrow(ax, (x + 0.05, block_y[1] - 0.1), (x + 0.05, block_y[3] + 0.1), GREEN,
               rad=-0.8, lw=LINE + 1.5)
        ax.text(x + 0.45, (block_y[1] + block_y[3]) / 2, "copy", va="center",
                fontsize=LABEL, color=GREEN, fontweight="bold")


def _cow_table(ax, y, s, table, color, block_y, after) -> None:
    """Sequence ``s``'s block table as a row of cells at height ``y``, arrows to its blocks."""
    ax.text(0.3, y, f"seq {s + 1}", fontsize=LABEL, fontweight="bold", color=color,
            va="center")
    if not after:
        ax.text(0.3, y - 0.6, f"next: \u201c{SAMPLES[s]}\u201d", fontsize=16, color=color,
                va="center", style="italic")
    for i, b in enumerate(table):
        x = 2.4 + 0.8 * i
        ax.add_patch(Rectangle((x, y - 0.31), 0.8, 0.62, facecolor="white", edgecolor=color,
                               lw=LINE + 0.5))
        ax.text(x + 0.4, y, str(b), ha="center", va="center", fontsize=LABEL, fontweight="bold")
        start = (x + 0.8, y) if i else (x + 0.4, y + 0.31)
        _arrow(ax, start, (6.45, block_y[b] + 0.1 * (0.5 - s)), color, rad=0.0 if i else -0.25)


def draw_copy_on_write(path: Path) -> None:
    """Figure 2: before and after the first write into a shared, partly filled block."""
    with rc_context(STYLE):
        fig, ax = _canvas()
        _cow_panel(ax, 4.75, after=False)
        ax.plot([0.3, 15.7], [4.5, 4.5], color=GREY, lw=LINE)
        _cow_panel(ax, 0.1, after=True)
        _save(fig, path)


# -- figure 3: one engine step ---------------------------------------------------------------
STAGES = (  # (title, detail, the module that does it), in LLMEngine.step's order
    ("1  schedule", "running, swapped, waiting;\ntoken + sequence budgets",
     "core/scheduler.py"),
    ("2  swap & copy", "swap out, swap in,\ncopy-on-write copies", "executor/executor.py"),
    ("3  run the model", "prefill + decode tokens\nin one batch", "executor/model_runner.py"),
    ("4  sample", "one token per\nready sequence", "sampling/group_processor.py"),
    ("5  detokenize & stop", "text; EOS, stop strings,\nmax_tokens", "postprocess/"),
    ("6  free, finish, report", "free finished blocks,\nreturn RequestOutputs",
     "core/ + engine.py"),
)
STAGE_COLORS = (BLUE, ORANGE, GREEN, SKY, PURPLE, VERMILION)
STAGE_XY = ((8.0, 7.55), (13.55, 5.65), (13.55, 2.95), (8.0, 1.05), (2.45, 2.95), (2.45, 5.65))


def draw_engine_step(path: Path) -> None:
    """Figure 3: the six stages of ``LLMEngine.step`` around a loop."""
    with rc_context(STYLE):
        fig, ax = _canvas()
        w, h = 4.6, 1.95
        for (x, y), (title, detail, module), color in zip(STAGE_XY, STAGES, STAGE_COLORS):
            ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                        boxstyle="round,pad=0.02,rounding_size=0.25",
                                        facecolor=LIGHT.get(color, "#DCEFFA"),
                                        edgecolor=color, lw=LINE + 1))
            ax.text(x, y + 0.6, title, ha="center", va="center", fontsize=LABEL + 2,
                    fontweight="bold")
            ax.text(x, y - 0.05, detail, ha="center", va="center", fontsize=16,
                    linespacing=1.15)
            ax.text(x, y - 0.68, module, ha="center", va="center", fontsize=16,
                    family="DejaVu Sans Mono", color=INK)
        for a, b in zip(STAGE_XY, STAGE_XY[1:] + STAGE_XY[:1]):
            _arrow(ax, _box_edge(a, b, w, h), _box_edge(b, a, w, h), INK, rad=-0.15,
                   lw=LINE + 1.5)
        ax.text(8.0, 4.65, "one engine step", ha="center", va="center", fontsize=TITLE + 4,
                fontweight="bold")
        ax.text(8.0, 3.9, "LLMEngine.step()", ha="center", va="center", fontsize=LABEL + 1,
                family="DejaVu Sans Mono")
        ax.text(4.2, 7.25, "next step", ha="center", va="center", fontsize=LABEL,
                style="italic", color="#555555")
        _save(fig, path)


def _box_edge(a, b, w, h):
    """Where the segment from box centre ``a`` towards ``b`` leaves the box at ``a``."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    scale = min(w / 2 / abs(dx) if dx else float("inf"), h / 2 / abs(dy) if dy else float("inf"))
    return a[0] + dx * scale, a[1] + dy * scale


# -- output ---------------------------------------------------------------------------------
FIGURES = {"paged_mapping": draw_paged_mapping, "copy_on_write": draw_copy_on_write,
           "engine_step": draw_engine_step}


def _save(fig: Figure, path: Path) -> None:
    """Write ``path``; its suffix picks the format (no date in an SVG, so reruns match)."""
    metadata = {"Date": None} if path.suffix == ".svg" else None
    fig.savefig(path, dpi=120, facecolor="white", metadata=metadata)


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("assets"), help="folder (default assets)")
    p.add_argument("--formats", default="png,svg", help="comma-separated (default png,svg)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        for fmt in args.formats.split(","):
            path = args.out / f"{name}.{fmt}"
            draw(path)
            written.append(path)
            print(f"wrote {path} ({path.stat().st_size // 1024} KB)")
    return written


if __name__ == "__main__":
    main()
