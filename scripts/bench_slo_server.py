"""``scripts/bench.py slo_server`` (scripts/benchmarks/slo_server.py), kept for the commands the docs and the
artefacts record: same arguments, same outputs. Importing it imports the benchmark (as gpu_checks' import
probe does)."""

import sys

import benchmarks.slo_server  # noqa: F401
from benchmarks import main

if __name__ == "__main__":
    sys.exit(main(["slo_server", *sys.argv[1:]]))
