"""Fault injection for the converter's resume tests: ``LEANSTREAM_TEST_KILL_AT=<point>:<n>`` makes
the process SIGKILL itself the n-th time (from 0) it passes ``kill_point(point)``, i.e. right
after that much work was made durable. Unset (always, outside tests) it does nothing."""

from __future__ import annotations

import os
import signal

_seen: dict[str, int] = {}


def kill_point(point: str) -> None:
    spec = os.environ.get("LEANSTREAM_TEST_KILL_AT")
    if not spec:
        return
    n = _seen.get(point, 0)
    _seen[point] = n + 1
    if spec == f"{point}:{n}":
        os.kill(os.getpid(), signal.SIGKILL)
