"""The benchmark scripts import one another by name (benchmarks/ on the path, as when run from there): so do their
tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
