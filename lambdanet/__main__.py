"""``python -m lambdanet`` runs the command-line interface."""

import sys

from lambdanet.cli import main

sys.exit(main())
