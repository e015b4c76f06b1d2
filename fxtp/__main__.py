import sys

from fxtp.cli.main import main

sys.exit(main())
