"""BASTION adaptive tree speculative decoding for stock SGLang.

`register` is the `sglang.srt.plugins` entry point; it imports SGLang only when SGLang calls it.
"""


def register() -> None:
    """SGLang plugin entry point: register `--speculative-algorithm BASTION` and the `--bastion-*` flags, and
    the hook through which `bastion step-anatomy` counts a scheduler process's decode steps (it counts
    nothing unless the process's arguments ask for it)."""
    from bastion_sglang.registration import register_algorithm
    from bastion_sglang.step.step_anatomy_hooks import register_step_anatomy

    register_algorithm()
    register_step_anatomy()
