import sys

from fxtp.cli import main

sys.exit(main())
