"""Connector unit tests: make the shared helpers here (kvsim) importable by plain name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
