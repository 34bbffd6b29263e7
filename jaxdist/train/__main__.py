"""``python -m jaxdist.train --config configs/default.yaml``."""

import sys

from jaxdist._src.job.cli import main

if __name__ == "__main__":
    sys.exit(main())
