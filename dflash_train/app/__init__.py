"""Entry points: the command line, its command handlers, and the quality recipe."""

import os
import sys

# Off a terminal (a log file), every tqdm progress bar is off by default: a bar redraws itself
# with carriage returns, which a log must not hold. tqdm reads its TQDM_* defaults once, when it
# is imported, so this comes before the command line imports any library that uses it (the GGUF
# conversion, datasets, transformers); processes started from here inherit it.
if not (sys.stdout.isatty() and sys.stderr.isatty()):
    os.environ.setdefault("TQDM_DISABLE", "1")
