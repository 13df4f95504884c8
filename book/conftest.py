"""nbval settings for the book: stderr (progress bars, warnings) is never compared."""

import os

# Chapters pick the Triton interpreter themselves when there is no GPU; make
# plots render off-screen and keep runs reproducible on any machine.
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_collectstart(collector):
    path = getattr(collector, "path", None)
    if path is not None and path.suffix == ".ipynb":
        collector.skip_compare += ("stderr",)
