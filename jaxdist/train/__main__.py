"""``python -m jaxdist.train --config configs/default.yaml``."""

import sys

from jaxdist._src.job.cli import main
from jaxdist._src.job.interrupt import install

if __name__ == "__main__":
    install()  # Ctrl-C: one line, exit 130 (already installed when `import jaxdist` ran first)
    sys.exit(main())
