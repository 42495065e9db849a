"""What of a file is in the page cache (mincore), and dropping a file's pages (posix_fadvise).

Standard library only. The page cache of a file a process reads is charged to its memory cgroup,
where a memory limit binds: the runtime drops what a whole-file check read (checksum.py), the
tools read residency to report and to start runs cold (leanstream_tools/measure.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_libc = None


def _get_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = libc
    return _libc


def resident_pages(fd: int, size: int) -> bytes | None:
    """One byte per page of the open file's first ``size`` bytes, bit 0 set where the page is in
    the page cache (mincore over a fresh read-only mapping, which itself faults nothing in).
    None where it cannot be told."""
    if size == 0:
        return b""
    try:
        libc = _get_libc()
    except OSError:
        return None
    addr = libc.mmap(None, size, 0x1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        if libc.mincore(addr, size, vec) != 0:
            return None
        return vec.raw
    finally:
        libc.munmap(addr, size)


def resident_bytes(path: str | os.PathLike) -> int | None:
    """Bytes of the file now in the page cache; None where it cannot be told."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        vec = resident_pages(fd, size)
    finally:
        os.close(fd)
    if vec is None:
        return None
    return min(sum(b & 1 for b in vec) * PAGE, size)


def drop_not_resident(fd: int, before: bytes | None, start: int, end: int) -> None:
    """Drop from the page cache the pages of [start, end) that ``before`` (resident_pages taken
    earlier) shows were not cached then: what this process's reads brought in, readahead
    included. Nothing when ``before`` is None."""
    if before is None or not hasattr(os, "posix_fadvise"):
        return
    p0, p1 = start // PAGE, min((end + PAGE - 1) // PAGE, len(before))
    p = p0
    while p < p1:
        if before[p] & 1:
            p += 1
            continue
        q = p
        while q < p1 and not before[q] & 1:
            q += 1
        os.posix_fadvise(fd, p * PAGE, (q - p) * PAGE, os.POSIX_FADV_DONTNEED)
        p = q
