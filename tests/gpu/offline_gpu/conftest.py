"""Puts the checkout's `tools/` on sys.path so these GPU tests import the offline-GPU tooling as
`offline_gpu` (it is not part of the installed package)."""

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[3] / "tools"
sys.path.insert(0, str(TOOLS))
