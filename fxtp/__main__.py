import sys

from fxtp.explain.cli import main

sys.exit(main())
