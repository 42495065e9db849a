"""The files of a model directory on disk: every path the manifest records resolves, symlinks
followed, to a regular file inside the directory (``resolve_inside``), is opened without
following a last link or blocking on a FIFO (``open_regular``), has its recorded size and its
checksum (``file_checksum``: the manifest's "crc32:<8 hex digits>"). Standard library only
(checksum.py, lazily, for the CRC).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from leanstream_ggml.model.sections import ManifestError


def resolve_inside(model_dir: str | os.PathLike, rel: str) -> Path:
    """Real path of model_dir/rel, which must be a regular file inside model_dir (symlinks
    resolved first: a link pointing outside the directory is refused)."""
    root = os.path.realpath(model_dir)
    real = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([root, real]) != root or real == root:
        raise ManifestError(f"{Path(model_dir) / rel}: resolves to {real}, outside the model directory {root}; "
                            f"model files must stay inside it")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise ManifestError(f"{Path(model_dir) / rel}: missing (the model directory is incomplete)") from None
    except OSError as e:
        raise ManifestError(f"{Path(model_dir) / rel}: cannot stat: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ManifestError(f"{Path(model_dir) / rel}: not a regular file (a FIFO, device or directory); "
                            f"model files must be regular files")
    return Path(real)


def open_regular(path: Path) -> int:
    """Open without following a last-component symlink or blocking on a FIFO; regular files only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise ManifestError(f"{path}: cannot open: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ManifestError(f"{path}: not a regular file")
    return fd


def check_size(path: Path, size: int) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (the model directory is incomplete)") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot stat: {e.strerror}") from None
    if actual != size:
        raise ManifestError(f"{path}: {actual} bytes, the manifest says {size} (truncated or replaced?)")


def file_checksum(path: Path) -> str:
    """The manifest's checksum of one file, "crc32:<8 hex digits>" (opened as a regular file only)."""
    from leanstream_ggml.model.checksum import file_crc32

    fd = open_regular(path)
    try:
        return f"crc32:{file_crc32(path, fd=fd):08x}"
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """``text`` into a file of the model directory by a rename, flushed to disk first: an
    interrupted write leaves the old file or none (what the runtime and the tools write there:
    the controller's policy, tune's quality band, the manifest after them)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
