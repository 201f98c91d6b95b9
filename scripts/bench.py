"""The benchmarks' one entry point: ``python scripts/bench.py NAME [args]`` runs benchmark NAME of
scripts/benchmarks/ (``--help`` lists them); without a NAME, the through-server benchmark (``server``), as
before, so the commands the docs and the artefacts record keep working."""

import sys

from benchmarks import main

if __name__ == "__main__":
    sys.exit(main())
