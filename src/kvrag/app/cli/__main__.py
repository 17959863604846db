"""`python -m kvrag.app.cli`, as the `kvrag` script."""

import sys

from .main import main

sys.exit(main())
