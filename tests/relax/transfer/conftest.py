"""Make ``transfer_helpers`` importable from these tests and from the subprocesses they start."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
