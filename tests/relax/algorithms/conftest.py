"""Make ``hand_values`` importable from these tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
