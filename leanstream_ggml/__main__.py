"""`python -m leanstream_ggml`: the `leanstream` command."""

import sys

from leanstream_ggml.cli import main

sys.exit(main())
