"""`python -m stacx.train ...` is `stacx train ...` (the form torchrun and `ray job submit` use)."""

import sys

from stacx.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
