"""`stacx train` with extra folders searched as part of `stacx/custom/` (tests only).

    STACX_TEST_CUSTOM_DIRS=/tmp/x python tests/launch/train_with_custom_folder.py --algorithm ...
    STACX_TEST_CUSTOM_DIRS=/tmp/x torchrun ... tests/launch/train_with_custom_folder.py --algorithm ...

A file in such a folder is imported exactly as if it had been placed in `stacx/custom/` (module
name `stacx.custom.<file>`), without writing into the shared source tree. Ray workers do not run
this script: they get the files only as the sources the driver ships, which is what is tested.
"""

import os
import sys

import stacx.custom

stacx.custom.__path__.extend(p for p in os.environ.get("STACX_TEST_CUSTOM_DIRS", "").split(os.pathsep) if p)

from stacx.launch.cli import main  # noqa: E402  (after the path is extended)

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
