"""``python -m loraplex.openai``: the same as ``loraplex-openai``."""

import sys

from loraplex.openai.cli import main

sys.exit(main())
