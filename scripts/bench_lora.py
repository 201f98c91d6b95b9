"""``scripts/bench.py lora`` (scripts/benchmarks/lora.py), kept for the commands the docs and the
artefacts record: same arguments, same outputs. Importing it imports the benchmark (as gpu_checks' import
probe does)."""

import sys

import benchmarks.lora  # noqa: F401
from benchmarks import main

if __name__ == "__main__":
    sys.exit(main(["lora", *sys.argv[1:]]))
