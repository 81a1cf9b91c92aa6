"""worker/engine/pages.py: letting go of a mapped model's pages (a stage's
``page_on_demand``) and counting the pages a process has mapped in."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from worker.engine import pages


def test_release_drops_read_only_shared_pages_and_nothing_else(tmp_path: Path) -> None:
    """What ``page_on_demand`` relies on: after ``release`` a read-only shared
    mapping holds no pages until read again (and reads the same bytes); a
    private writable mapping of the same file keeps its pages and its writes."""
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(7).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    size = len(data)
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as shared:
        assert shared[:] == data  # every page read: all mapped
        assert pages.mapped_bytes(path, 0, size) == size
        with path.open("r+b") as fw, mmap.mmap(fw.fileno(), 0, access=mmap.ACCESS_COPY) as mine:
            mine[:4] = b"mine"  # a private copy of the first page
            assert pages.release(path) == size  # the shared mapping only
            assert pages.mapped_bytes(path, 0, size) == 0
            assert mine[:4] == b"mine" and mine[4:] == data[4:]
        assert shared[:] == data
        assert pages.mapped_bytes(path, 0, size) == size
    assert pages.release(path) == 0  # no mapping left
