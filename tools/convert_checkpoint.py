"""Run sana2-convert from a checkout: python tools/convert_checkpoint.py <source> <output> [options]."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, when sana2 is not installed

from sana2.tools.convert_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
