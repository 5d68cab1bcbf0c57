"""Start-up calibration's acceptance records for a DFlash2 drafter (`SglangMeasurement.greedy_records`): in
SGLang's own forwards (a target ModelRunner on CPU, fp32, torch_native, built in a subprocess: SGLang's
runtime context is process-global), every root gives a `LatticeRecord` whose [D, K, K] transitions and [D, K]
candidates are the reference `DFlash2Proposer`'s lattice on the Transformers target's features, and whose
continuation is the target's greedy continuation (slow: 50 to 90 s on two cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_support import PROMPTS, make_model_pair
from tiny_dflash2 import make_tiny_dflash2_drafter
from transformers import AutoModelForCausalLM

from bastion_sglang.controller.lattice_acceptance import LatticeRecord
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.reference.lattice_proposer import DFlash2Proposer
from bastion_sglang.reference.target import TargetModel
from bastion_sglang.step.draft_protocols import DraftInput

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
TOP_K = 4  # the selector's K
DEPTH = 15  # block size 16

MEASURE = """
import json, sys, torch
from bastion_sglang.calibration.sglang_runner import open_sglang_measurement
target, drafter, prompts_json, out = sys.argv[1:5]
prompts = json.loads(prompts_json)
measurement = open_sglang_measurement(
    target, drafter, device=torch.device("cpu"), dtype=torch.float32, attention_backend="torch_native",
    max_context=256, max_width=16,
)
try:
    per_prompt = measurement.greedy_records(prompts, int(sys.argv[5]), 4, set())
finally:
    measurement.close()
rows = [[(type(r).__name__, r.transitions, r.token_ids, r.continuation) for r in rs] for rs in per_prompt]
torch.save(rows, out)
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny target and a random DFlash2 drafter reading target layers 0 and 2 (the default spread reads
    layer 1 twice, which SGLang captures once)."""
    root = tmp_path_factory.mktemp("dflash2_records")
    target, _ = make_model_pair(root)
    drafter = make_tiny_dflash2_drafter(
        root / "dflash2", target, top_k=TOP_K, output_multiplier=0.5, final_logit_softcapping=3.0
    )
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 2]
    (drafter / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return target, drafter


def test_greedy_records_of_a_dflash2_drafter_are_the_reference_lattices(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, drafter = pair
    prompts = [PROMPTS[0], PROMPTS[3]]
    out = tmp_path / "records.pt"
    argv = [sys.executable, "-c", MEASURE, str(target), str(drafter), json.dumps(prompts), str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*argv, str(NEW_TOKENS)], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    per_prompt = torch.load(out)

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    reference = DFlash2Proposer(
        DFlashDrafter.from_pretrained(drafter, device="cpu", dtype=torch.float32, target_num_layers=4).eval(),
        model.get_input_embeddings(),
        model.get_output_embeddings(),
    )
    target_model = TargetModel(model, reference.feature_layers)
    for prompt, rows in zip(prompts, per_prompt, strict=True):
        assert len(rows) == NEW_TOKENS
        greedy = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS + DEPTH):  # the target's greedy continuation, EOS or not
                greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
            out_ = model(torch.tensor([greedy]), output_hidden_states=True)
        features = torch.cat([out_.hidden_states[layer + 1][0] for layer in target_model.feature_layers], -1)
        for r, (kind, transitions, token_ids, continuation) in enumerate(rows):
            root = len(prompt) + r
            assert kind == "LatticeRecord"
            assert transitions.shape == (DEPTH, TOP_K, TOP_K) and token_ids.shape == (DEPTH, TOP_K)
            assert transitions.dtype == torch.float32
            assert list(continuation) == greedy[root + 1 : root + 1 + DEPTH]
            reference.start(root + 2)
            lattice = reference.propose(DraftInput(torch.tensor(greedy[: root + 1]), features[:root]), TOP_K)
            assert torch.equal(token_ids, lattice.unary.token_ids[0])
            torch.testing.assert_close(transitions, lattice.transitions[0], atol=1e-3, rtol=1e-3)
            LatticeRecord(transitions, token_ids, tuple(continuation))  # a well-formed record
