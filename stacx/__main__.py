import sys

from stacx.launch.cli import main

sys.exit(main())
