"""``python -m benchmarks``: the benchmark suite in benchmarks/run.py."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import run  # pylint: disable=wrong-import-position

run.main()
