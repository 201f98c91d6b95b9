"""``scripts/bench.py caches`` (scripts/benchmarks/caches.py), kept for the commands the docs and the
artefacts record: same arguments, same outputs. Importing it imports the benchmark (as gpu_checks' import
probe does)."""

import sys

import benchmarks.caches  # noqa: F401
from benchmarks import main

if __name__ == "__main__":
    sys.exit(main(["caches", *sys.argv[1:]]))
