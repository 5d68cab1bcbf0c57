#!/usr/bin/env bash
# The heavy lane of SGLang's speculative-server kits against a BASTION server of the demo pair on CPU
# (tests/spec_kits_heavy.py; the suite runs the rest in tests/test_spec_server_kits.py). Not part of CI.
# Extra arguments go to pytest (e.g. -k radix).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -s --durations=0 tests/spec_kits_heavy.py "$@"
