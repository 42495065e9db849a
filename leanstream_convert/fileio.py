"""Writing files so that a crash never leaves a half-written one under the final name, and
hashing them. Standard library only; the converter's (the runtime reads model directories, it
never writes one).

    atomic_write_bytes(path, data)          # temp name + fsync + rename (+ fsync of the folder)
    with atomic_writer(path) as f: ...      # the same for a file written piece by piece
    sha256_file(path, progress=True)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

PARTIAL = ".partial"   # suffix of a file being written; removed on failure, swept on restart


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames inside a folder durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb", *, durable: bool = True) -> Iterator[Any]:
    """Open ``path + PARTIAL`` for writing; on success fsync it and rename it to ``path``, on any
    error remove it. durable: also fsync the data and the folder (off for scratch files)."""
    path = Path(path)
    tmp = path.with_name(path.name + PARTIAL)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    with atomic_writer(path, "wb", durable=durable) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = True) -> None:
    with atomic_writer(path, "w", durable=durable) as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n", durable=durable)


def sha256_file(path: str | os.PathLike, *, progress: bool = False, desc: str = "hashing",
                chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, with a progress bar for big files when asked."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=desc, leave=False)
    try:
        with open(path, "rb") as f:
            while b := f.read(chunk):
                h.update(b)
                if bar is not None:
                    bar.update(len(b))
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest()
