"""Tooling that carries SGLang and the benchmarks' inputs to a GPU machine with no network (`README.md`).

Not part of the installed package: this folder is used from a checkout of the repository, with `tools/` on
`sys.path` (the shell scripts here set `PYTHONPATH`; the tests put it there in their `conftest.py`), and
imported as `offline_gpu`. `REPO_ROOT` is therefore the checkout this folder lies in.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository checkout holding `tools/offline_gpu/` (never an installed package's location)."""
