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
