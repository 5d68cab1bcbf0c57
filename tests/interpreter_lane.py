"""The Triton interpreter lane: runs a test module of `tests/interpreted/` in a pytest subprocess with
`TRITON_INTERPRET=1`, so Triton kernels (BASTION's and SGLang's) execute on CPU tensors.

The environment variable must be set before `triton` is first imported: `@triton.jit` decides at
decoration time whether a kernel is compiled or interpreted, and this process may have imported triton
already (through SGLang). Hence a fresh interpreter per module. The modules under `tests/interpreted/`
carry no `test_` prefix, so the ordinary collection never imports them outside the lane; each one refuses
to run when its kernels are not interpreted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = Path(__file__).parent / "interpreted"
"""The folder of the modules the lane runs."""

LANE_TIMEOUT_S = 540
"""Default wall-clock limit of one module's subprocess, in seconds (below pytest-timeout's 600 s, so the
module's output is kept)."""


def run_interpreted(module: str, timeout_s: float = LANE_TIMEOUT_S) -> str:
    """Run `tests/interpreted/<module>` under Triton's interpreter in a pytest subprocess.

    Returns the subprocess's output when every test passed; otherwise fails the calling test with the
    exit code and the whole output (also when it runs past `timeout_s` seconds, below the calling test's
    pytest-timeout). `-P` keeps the working directory off `sys.path` (the repository root
    holds a `kernels/` folder that Transformers would take for the Hugging Face `kernels` package).
    """
    path = INTERPRETED / module
    if not path.is_file():
        raise ValueError(f"no interpreter-lane module {path}")
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [
        sys.executable,
        "-P",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=5",
        f"--timeout={int(timeout_s)}",
        str(path),
    ]
    try:
        done = subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=Path(__file__).parent.parent,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(
            f"{module} ran past {timeout_s} s under the interpreter:\n{timeout.stdout!s}", pytrace=False
        )
    output = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(
            f"{module} failed under the interpreter (exit {done.returncode}):\n{output}", pytrace=False
        )
    return output


def require_interpreted(*kernels: object) -> None:
    """Raise RuntimeError unless every one of `kernels` (`@triton.jit` functions) runs under the interpreter:
    a module of `tests/interpreted/` calls this at import, so it fails rather than runs compiled kernels."""
    from triton.runtime.interpreter import InterpretedFunction

    compiled = [repr(kernel) for kernel in kernels if not isinstance(kernel, InterpretedFunction)]
    if os.environ.get("TRITON_INTERPRET") != "1" or compiled:
        raise RuntimeError(
            f"kernels {compiled} are not interpreted: run this module through tests/interpreter_lane.py "
            "(TRITON_INTERPRET=1 set before triton is imported)"
        )
