"""`python -m tlt_rt.compare RUN_DIR [RUN_DIR ...] --out DIR` (tlt_rt/compare/__init__.py)."""

import sys

from tlt_rt.compare import main

sys.exit(main())
