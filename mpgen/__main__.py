import sys

from mpgen.cli import main

sys.exit(main())
