"""The model directory and its files: the manifest and its sections, the binary formats and their
headers, checksums, what a sparse mode reads, the page cache of its files, and the registry of real
models a conversion starts from."""
