"""Structural checks of a source GGUF, the ones llama.cpp's loader makes (ggml/src/gguf.cpp),
so that a file stock llama.cpp refuses is refused here too instead of converting into a model
that computes garbage.

    problems = check_tensors(reader, file_size)     # [] when the layout is sound

gguf-py's reader maps whatever the header says; it does not check that tensors are where the
loader expects them. llama.cpp requires, for the tensors in file order:

- each dimension >= 0 and at most 4 of them; ne[0] a multiple of the type's block size;
- tensor i's offset (relative to the data section) == the sum of the sizes of tensors 0..i-1,
  each padded to general.alignment (so offsets are aligned, in order and never overlap);
- the data section inside the file.

Changing a tensor's type in the header (F32 for Q4_0, say) changes its byte size, so the next
offset no longer matches: that is how such a file is caught.
"""

from __future__ import annotations

MAX_DIMS = 4
MAX_NAME = 63          # GGML_MAX_NAME - 1


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def check_tensors(reader, file_size: int) -> list[str]:
    """Problems with the tensor layout of a gguf-py GGUFReader (empty list: none)."""
    import gguf

    problems: list[str] = []
    align = int(reader.alignment)
    if align <= 0 or align & (align - 1):
        return [f"general.alignment {align} is not a power of two"]
    data_start = int(reader.data_offset)
    if data_start % align:
        problems.append(f"the data section starts at byte {data_start}, not a multiple of the alignment {align}")
    expected = 0
    for t in reader.tensors:
        name = t.name
        dims = [int(x) for x in t.shape]
        if len(name.encode()) > MAX_NAME:
            problems.append(f"tensor name {name[:40]!r}... longer than {MAX_NAME} bytes")
        if len(dims) > MAX_DIMS or any(d < 0 for d in dims):
            problems.append(f"tensor {name}: bad shape {dims}")
            continue
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if dims and dims[0] % block:
            problems.append(f"tensor {name}: row length {dims[0]} is not a multiple of the {t.tensor_type.name} "
                            f"block size {block}")
            continue
        n_bytes = t.n_elements // block * type_size
        offset = int(t.data_offset) - data_start
        if offset != expected:
            problems.append(f"tensor {name} ({t.tensor_type.name}, shape {dims}) is at data offset {offset}, "
                            f"expected {expected} (misplaced, overlapping, or a type/shape that does not match "
                            f"its bytes)")
            break   # every later offset would be off as well
        expected += _pad(n_bytes, align)
    if not problems and reader.tensors:
        t = reader.tensors[-1]
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        end = int(t.data_offset) + t.n_elements // block * type_size
        if end > file_size:
            problems.append(f"tensor {t.name} ends at byte {end}, past the end of the file ({file_size} bytes)")
    return problems
