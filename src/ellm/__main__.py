"""`python -m ellm ...` is the `ellm` command."""
import sys

from .cli import main

sys.exit(main())
