"""``python -m skipinject``: see :mod:`skipinject.cli`."""

import sys

from skipinject.cli import main

if __name__ == "__main__":
    sys.exit(main())
