"""``scripts/bench.py slo`` (scripts/benchmarks/slo.py), kept for the commands the docs and the
artefacts record: same arguments, same outputs. Importing it imports the benchmark (as gpu_checks' import
probe does)."""

import sys

import benchmarks.slo  # noqa: F401
from benchmarks import main

if __name__ == "__main__":
    sys.exit(main(["slo", *sys.argv[1:]]))
