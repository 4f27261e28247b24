"""`python -m tkbox_nb.kernel -f CONNECTION_FILE`: what kernel.json starts."""

import sys

from .app import main

sys.exit(main())
