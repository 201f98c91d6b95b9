"""``scripts/bench.py engines`` (scripts/benchmarks/engines.py), kept for the commands the docs and the
artefacts record: same arguments, same outputs. Importing it imports the benchmark (as gpu_checks' import
probe does)."""

import sys

import benchmarks.engines  # noqa: F401
from benchmarks import main

if __name__ == "__main__":
    sys.exit(main(["engines", *sys.argv[1:]]))
