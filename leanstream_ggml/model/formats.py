"""The model directory's binary formats: their magics, versions and fixed sizes, written once
(docs/formats.md). The converter writes with these values, the runtime reads with them (Python:
blockfile.py, manifest.py; C: native/src/blockfile.c, sketch.c, which check the same values;
tests/unit/test_formats.py compares them with what native/include/leanstream.h defines). Standard
library only: nothing is imported.
"""

# block and sketch files: a header padded with zeros to this size (a page: the tables and rows
# that follow start O_DIRECT-aligned); a block file's perm table starts here, its data_offset
# is a multiple of it
HEADER_BYTES = 4096

# ffn/blk.<il>.bin
MIN_ALIGN = 512        # block.align: O_DIRECT's alignment of data_offset and block_stride, a power of two >= this
BLOCK_MAGIC = b"LSBLOCKS"
BLOCK_VERSION = 2      # LS_BLOCK_FILE_VERSION

# sketch/blk.<il>.lssk
SKETCH_MAGIC = b"LSSKETCH"
SKETCH_VERSION = 1
SKETCH_LS2 = 1         # LS_SKETCH_LS2: the row format (2-bit codes, one f16 scale per 32 values)

# predictor/blk.<il>.lspred
PREDICTOR_MAGIC = b"LSPREDv\0"
PREDICTOR_VERSION = 2  # LS_PREDICTOR_FILE_VERSION (version 1 files are read too)
PREDICTOR_HEADER_BYTES = 256

# experts/blk.<il>.bin: one MoE layer's routed experts, one per slot (docs/formats.md "Expert file")
EXPERT_MAGIC = b"LSEXPRTS"
EXPERT_VERSION = 1     # LS_EXPERT_FILE_VERSION
# the header's fields in order (struct codes, little-endian), zero-padded to HEADER_BYTES; the
# expert_of_slot table starts at HEADER_BYTES; meta_crc is the CRC-32C of [0, data_offset) with
# its own field read as zero
EXPERT_HEADER_FIELDS = (
    ("magic", "8s"), ("version", "I"), ("il", "I"), ("n_embd", "Q"), ("n_ff_exp", "Q"), ("n_expert", "I"),
    ("align", "I"), ("gate_type", "i"), ("up_type", "i"), ("down_type", "i"), ("flags", "I"),
    ("gate_bytes", "Q"), ("up_bytes", "Q"), ("down_bytes", "Q"), ("expert_stride", "Q"), ("table_offset", "Q"),
    ("data_offset", "Q"), ("file_size", "Q"), ("meta_crc", "I"),
)
EXPERT_META_CRC_OFFSET = 112
# flags: what a slot holds before its gate rows, f32: the biases (gate [n_ff_exp], up [n_ff_exp],
# down [n_embd]), then the scales (gate, up, down), padded to EXPERT_EXTRA_ALIGN bytes
EXPERT_BIASES = 1      # LS_EXPERT_BIASES
EXPERT_SCALES = 2      # LS_EXPERT_SCALES
EXPERT_EXTRA_ALIGN = 64


def expert_extra_bytes(flags: int, n_embd: int, n_ff_exp: int) -> int:
    """Bytes of a slot's f32 extras (ls_expert_extra_bytes)."""
    n = (2 * n_ff_exp + n_embd if flags & EXPERT_BIASES else 0) + (3 if flags & EXPERT_SCALES else 0)
    return (4 * n + EXPERT_EXTRA_ALIGN - 1) // EXPERT_EXTRA_ALIGN * EXPERT_EXTRA_ALIGN
