"""One line for every error a user can cause or fix, at the command line's boundary.

``describe(exc)`` turns the exceptions the commands raise for bad input or a bad environment
(OS errors, a bad model directory, a bad parameter, a corrupt file) into one line naming the
path and, where there is one, the fix; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno

# what to do about an OS error, by errno
_FIX = {
    errno.ENOSPC: "free some disk space or choose another output directory",
    errno.EDQUOT: "the disk quota is exhausted: free some space or choose another output directory",
    errno.EFBIG: "the file is larger than the file size limit (ulimit -f) or the file system allows",
    errno.EROFS: "the file system is read-only: choose another output directory",
    errno.EACCES: "permission denied: check the permissions, or choose another path",
    errno.EPERM: "operation not permitted: check the permissions, or choose another path",
    errno.ENOTDIR: "a component of the path is a file, not a directory: choose another path",
    errno.EISDIR: "it is a directory: give a file",
    errno.ENOENT: "no such file or directory: check the path",
    errno.EEXIST: "it already exists",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "the path is too long",
    errno.EIO: "input/output error: the disk may be failing",
}


def describe(exc: BaseException) -> str | None:
    """One line for an error the user can act on, or None for an unexpected one (a bug)."""
    from leanstream_ggml.model import manifest
    from leanstream_ggml import memplan
    from leanstream_ggml.native import params

    if isinstance(exc, OSError) and exc.errno is not None:
        where = exc.filename if exc.filename is not None else ""
        if exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        fix = _FIX.get(exc.errno)
        what = exc.strerror or str(exc)
        line = f"{where}: {what}" if where else what
        return f"{line} ({fix})" if fix and fix.split(":")[0].lower() != what.lower() else line
    from leanstream_ggml.model.registry import FetchError

    if isinstance(exc, (manifest.ManifestError, params.ParameterError, memplan.MemoryPlanError, FetchError)):
        return str(exc)
    # by name: the runtime never imports the converter, nor the native library just to classify
    if type(exc).__name__ in ("ConvertError", "LeanstreamError", "ControllerError"):
        return str(exc)
    return None
