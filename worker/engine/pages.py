"""Let go of a model file's pages after loading, so only what is read stays.

Why: llama.cpp maps the GGUF with ``MAP_POPULATE`` (``llama-mmap.cpp``:
whenever the model marks no lazily read tensor, which Gemma 3 does not),
faulting every page of the file into the process at load. A pipeline stage's
slice holds stand-ins it never reads (``worker/slice/slicer.py``) and the
first stage reads only the embedding rows of its tokens, yet with the whole
file populated every stage's resident set held all of it (measured: the
middle stage of a 3-way split 195 MiB of model pages for 23 MiB of its own
weights).

``release(path)`` calls ``madvise(MADV_DONTNEED)`` over this process's
read-only shared mappings of the file. For such a mapping that only drops
the page-table entries: the pages stay in the page cache, and the next read
of an address maps the file's page again (a minor fault, no I/O). So
afterwards the resident set counts exactly the pages read since (plus the
kernel's fault-around: up to 64 KiB of already-cached neighbours mapped with
each fault). A private or writable mapping is never touched: dropping it
could discard data. Linux only (``/proc/self/maps``); elsewhere it does
nothing and returns 0.

``mapped_bytes`` reads ``/proc/PID/pagemap`` to say how much of a file range
a process has mapped in: how the tests show a stand-in was never read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MADV_DONTNEED = 4  # <sys/mman.h>, Linux


def file_mappings(path: str | Path, pid: int | str = "self") -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each read-only shared mapping of ``path``
    in process ``pid``."""
    target = os.path.realpath(path)
    found: list[tuple[int, int, int]] = []
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[5].rstrip("\n") != target:
                    continue
                perms = fields[1]
                if perms[1] != "-" or perms[3] != "s":  # writable or private
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, int(fields[2], 16)))
    except OSError:
        return []
    return found


def release(path: str | Path) -> int:
    """Drop this process's mapped pages of ``path``; the bytes of address
    range advised (0 where unsupported)."""
    mappings = file_mappings(path)
    if not mappings:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    done = 0
    for start, end, _ in mappings:
        if libc.madvise(start, end - start, MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) on {path}: {os.strerror(err)}")
        done += end - start
    return done


def mapped_bytes(path: str | Path, start: int, end: int, pid: int | str = "self") -> int:
    """Bytes of ``path``'s range ``[start, end)`` that process ``pid`` has
    mapped in now, in its read-only shared mappings (bit 63 of each page's
    ``/proc/PID/pagemap`` entry: present)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for vstart, vend, offset in file_mappings(path, pid):
            lo, hi = max(start, offset), min(end, offset + vend - vstart)
            if lo >= hi:
                continue
            first = (vstart + lo - offset) // page
            last = (vstart + hi - offset - 1) // page
            pagemap.seek(first * 8)
            entries = memoryview(pagemap.read((last - first + 1) * 8)).cast("Q")
            total += sum(1 for entry in entries if entry >> 63) * page
    return total
