"""`python -m app.cli`: as the `phasescope` command."""
import sys

from . import main

sys.exit(main())
