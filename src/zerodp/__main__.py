"""`python -m zerodp ...` is the `zerodp` command."""
import sys

from zerodp.cli import main

sys.exit(main())
