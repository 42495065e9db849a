"""`leanstream verify DIR`: check every byte of a model directory against its checksums.

    leanstream verify model.lsm        # exit 0: intact; 1: one line per problem found

Checks, in order: the manifest (parsed, validated, every path a regular file inside the
directory, sizes); the CRC-32 of base.gguf and of the predictor files against the manifest; for
each block file its header against the manifest, the CRC-32C of its tables (meta_crc) and of
every block; for each expert file (a mixture-of-experts model) its header against the manifest,
meta_crc and every expert's CRC-32C. The runtime makes the same checks lazily (blocks as they are read); this command
reads everything once, e.g. after copying a model or when a read reported corruption.
Standard library and numpy only: it does not load llama.cpp or run the native engine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

CHUNK_BYTES = 64 << 20   # blocks checked per read


def verify_dir(model_dir: str | os.PathLike, progress=None) -> tuple[list[str], dict]:
    """(problems, counts) for a model directory; problems is empty when it is intact."""
    from leanstream_ggml.model import blockfile
    from leanstream_ggml.model import manifest as mf
    from leanstream_ggml.model.checksum import crc32c_rows

    d = Path(model_dir)
    problems: list[str] = []
    counts = {"files": 0, "blocks": 0, "bytes": 0}
    try:
        m = mf.load(d)
    except mf.ManifestError as e:
        return [str(e)], counts
    for rel in m.checksummed_files():
        try:
            path = m.resolve(d, rel)
            have = mf.file_checksum(path)
        except mf.ManifestError as e:
            problems.append(str(e))
            continue
        counts["bytes"] += path.stat().st_size
        counts["files"] += 1
        want = m.checksums.get(rel)
        if want is None:
            problems.append(f"{path}: no checksum recorded in the manifest")
        elif have != want:
            problems.append(f"{path}: corrupt (checksum {have}, the manifest records {want})")
    for e in m.layers:
        try:
            path = m.resolve(d, e.file)
            fd = mf.open_regular(path)
        except mf.ManifestError as err:
            problems.append(str(err))
            continue
        counts["files"] += 1
        try:
            problems += _verify_layer(fd, path, e, m, blockfile, crc32c_rows, counts)
        finally:
            os.close(fd)
        if progress:
            progress(e.il, m.n_layer)
    for il, e in m.moe.expert_layers() if m.moe else ():
        problems += _verify_experts(m.resolve(d, e.file), il, e, m, crc32c_rows, counts)
    return problems, counts


def _verify_experts(path: Path, il: int, e, m, crc32c_rows, counts) -> list[str]:
    """A mixture-of-experts layer's expert file: its header and tables (blockfile.read_expert_header)
    against the manifest, then every slot's CRC-32C."""
    from leanstream_ggml.model.blockfile import read_expert_header

    try:
        h = read_expert_header(path)
    except (OSError, ValueError) as err:
        return [str(err)]
    counts["files"] += 1
    got = (h["il"], h["n_expert"], h["n_ff_exp"], h["n_embd"], h["gate_type"], h["up_type"], h["down_type"],
           h["expert_stride"], h["data_offset"], h["file_size"])
    want = (il, m.moe.n_expert, m.moe.n_ff_exp, m.n_embd, e.gate_type, e.up_type, e.down_type, e.expert_stride,
            e.data_offset, e.file_size)
    if got != want:
        return [f"{path}: header (il, n_expert, n_ff_exp, n_embd, types, stride, data_offset, file_size) = {got}, "
                f"the manifest says {want}"]
    out, stride = [], h["expert_stride"]
    with open(path, "rb") as f:
        for s0 in range(0, h["n_expert"], max(1, CHUNK_BYTES // stride)):
            n = min(max(1, CHUNK_BYTES // stride), h["n_expert"] - s0)
            raw = os.pread(f.fileno(), n * stride, h["data_offset"] + s0 * stride)
            if len(raw) != n * stride:
                return out + [f"{path}: short read at slot {s0} (file truncated?)"]
            have = crc32c_rows(np.frombuffer(raw, np.uint8).reshape(n, stride))
            for s in np.flatnonzero(have != h["slot_crc"][s0:s0 + n]):
                out.append(f"{path}: layer {il} slot {s0 + int(s)} (expert {int(h['expert_of_slot'][s0 + s])}) is "
                           f"corrupt (CRC-32C {int(have[s]):08x}, stored {int(h['slot_crc'][s0 + s]):08x})")
            counts["blocks"] += n
            counts["bytes"] += len(raw)
    return out


def _verify_layer(fd, path, e, m, blockfile, crc32c_rows, counts) -> list[str]:
    head = os.pread(fd, blockfile.HEADER_BYTES, 0)
    try:
        h = blockfile.BlockHeader.unpack(head, where=str(path))
    except blockfile.BlockFileError as err:
        return [str(err)]
    got = (h.il, h.n_blocks, h.block_stride, h.data_offset, h.file_size, h.k, h.n_embd, h.n_ff)
    want = (e.il, e.n_blocks, e.block_stride, e.data_offset, e.file_size, m.block.k, m.n_embd, m.n_ff)
    if got != want:
        return [f"{path}: header (il, n_blocks, stride, data_offset, file_size, k, n_embd, n_ff) = {got}, "
                f"the manifest says {want}"]
    if not (0 < h.crc_offset and h.crc_offset + 4 * h.n_blocks <= h.data_offset <= h.file_size):
        return [f"{path}: bad table offsets in the header"]
    meta = os.pread(fd, h.data_offset, 0)
    if len(meta) != h.data_offset or not blockfile.check_meta(meta, h):
        return [f"{path}: layer {e.il}: header or tables corrupt (meta_crc mismatch)"]
    crcs = np.frombuffer(meta, "<u4", count=h.n_blocks, offset=h.crc_offset)
    out = []
    per = max(1, CHUNK_BYTES // h.block_stride)
    for b0 in range(0, h.n_blocks, per):
        n = min(per, h.n_blocks - b0)
        raw = os.pread(fd, n * h.block_stride, h.data_offset + b0 * h.block_stride)
        if len(raw) != n * h.block_stride:
            return out + [f"{path}: short read at block {b0} (file truncated?)"]
        have = crc32c_rows(np.frombuffer(raw, np.uint8).reshape(n, h.block_stride))
        for b in np.flatnonzero(have != crcs[b0:b0 + n]):
            out.append(f"{path}: layer {e.il} block {b0 + int(b)} is corrupt (CRC-32C {int(have[b]):08x}, "
                       f"stored {int(crcs[b0 + b]):08x})")
        counts["blocks"] += n
        counts["bytes"] += len(raw)
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    problems, counts = verify_dir(args.dir)
    for p in problems:
        print(f"leanstream verify: {p}", file=sys.stderr)
    if problems:
        print(f"{args.dir}: {len(problems)} problem(s); re-run `leanstream convert` with --force to repair",
              file=sys.stderr)
        return 1
    print(f"{args.dir}: intact ({counts['files']} files, {counts['blocks']} blocks, "
          f"{counts['bytes'] / 1e6:.1f} MB checked)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check a model directory against its checksums",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="model directory from `leanstream convert`")
    p.set_defaults(func=cmd_verify)
