"""Start the README's launch line for the demo pair on this machine's GPU, answer one chat request, stop.

    python3 tools/offline_gpu/serve_once.py --target DIR [demo-serve flags, e.g. --log FILE --max-tokens 64]

`bastion demo serve` without its target set-up (the GPU machine lacks the demo target's package, so
`gpu-pair-bench.sh prepare` builds the target from the carried GGUF first): `demo_serve.run` starts
`python -m sglang.launch_server --model-path TARGET --speculative-algorithm BASTION
--speculative-draft-model-path models/smollm2-135m-instruct-dflash --enable-metrics` (no attention backend
flag on CUDA: SGLang picks its default), waits for `/health_generate`, sends one chat completion, prints
the answer and the `sglang:bastion_*` metrics and stops the server. Exit status 0 when the request was
answered.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bastion_sglang.demo import serve as demo_serve


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--target", type=Path, required=True, help="the converted demo target's folder")
    demo_serve.add_arguments(parser)
    args = parser.parse_args(argv)
    if not (args.target / "config.json").is_file():
        message = f"error: --target {args.target}: no config.json (run gpu-pair-bench.sh prepare first)"
        print(message, file=sys.stderr)
        return 1
    return demo_serve.run(args, args.target)


if __name__ == "__main__":
    sys.exit(main())
