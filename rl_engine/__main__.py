import sys

from rl_engine.cli import main

sys.exit(main())
