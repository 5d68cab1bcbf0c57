"""BASTION adaptive tree speculative decoding for stock SGLang.

`register` is the `sglang.srt.plugins` entry point; it imports SGLang only when SGLang calls it.
"""


def register() -> None:
    """SGLang plugin entry point: register `--speculative-algorithm BASTION` and the `--bastion-*` flags."""
    from bastion_sglang.registration import register_algorithm

    register_algorithm()
