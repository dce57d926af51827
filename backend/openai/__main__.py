"""``python -m loraplex.openai``: the same as ``loraplex-openai``."""

import sys

from .cli import main

sys.exit(main())
