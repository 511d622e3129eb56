"""DSBD vs beam sampling vs EMS-SD sampling (code in ``specdec.bench.beams``; also ``specdec bench beams``)."""

import sys

from specdec.bench.beams import main

if __name__ == "__main__":
    sys.exit(main())
