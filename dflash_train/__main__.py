"""`python -m dflash_train`: the `dflash-train` command."""

import sys

from dflash_train.app.cli import main

sys.exit(main())
