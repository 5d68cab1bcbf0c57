"""Puts tests/ on sys.path so test modules can import the shared helpers (`from tiny_models import ...`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
