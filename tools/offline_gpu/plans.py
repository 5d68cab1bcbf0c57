"""The GPU items as data: for each, the commands to run back to back on a lent GPU machine.

    tools/offline_gpu/plan ITEM        # prints the item's build steps here, then each command there
    tools/offline_gpu/plan --list      # the items, in the order they are to be run

An item (`Item`) is a list of `GpuCommand`s. Each command names the folders carried with it (relative to the
repository root, built here by the `BuildStep`s it names), the command line run there from the repository
root (wrapped by `record.py`, which writes `meta.json` and `log.txt` into `$OUT/<name>`), its time limit
and the seconds it is expected to take. Sizes: the repository's files (`gpu_carry.repository_bytes`) plus the
folders, each taken from what its build step recorded when the folder exists here, else from the bound the
step documents, so the check needs no build and no network.

Carrying the demo target: the GGUF parts of `gpu-pair-bench.sh pack` take several calls; the trimmed SGLang
bundle rides with the last, smallest part when the two fit one call (else in its own call before it).

Expected seconds are estimates until a run records its wall seconds (`meta.json`); the constants below say
what each assumes. The machine's start-up (`STARTUP_S`) and a transfer per call (`CALL_OVERHEAD_S`) count.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from offline_gpu import REPO_ROOT
from offline_gpu.gpu_bundle import MANIFEST as BUNDLE_MANIFEST
from offline_gpu.gpu_bundle import folder_bytes
from offline_gpu.gpu_carry import CALL_LIMIT_BYTES, MANIFEST_NAME, MANIFEST_RESERVE_BYTES, MARGIN_BYTES
from offline_gpu.results import PUBLISHED_PROFILES

MIB = 2**20
STARTUP_S = 120
"""A fresh machine's start before the first command runs. Measured on 2026-11-27 (one H200): 95 s from the
first call to the end of its 7 s command, 63 MiB carried; 120 keeps a margin."""
CALL_OVERHEAD_S = 30
"""Per call: sending the repository and the carried folders, starting the command, fetching $OUT (measured
on 2026-11-27: 7 to 9 s for calls of 63 MiB and 50 MiB to a warm machine; 30 keeps a margin)."""
MAX_LIMIT_S = 9 * 60
"""A command's time limit at most (the machine allows 10 minutes)."""
MAX_ITEM_MINUTES = 15.0
"""The GPU time of one lending."""
DEMO_ENGINE_RUN_S = 40
"""One policy of `bastion bench` on the demo pair: an Engine started (CUDA graphs captured), both
temperatures decoded (at most 64 prompts of 128 tokens), stopped."""
QWEN3_8B_ENGINE_RUN_S = 75
"""The same for the dummy-weight Qwen3-8B target and its DFlash-b16-shaped drafter."""
INSTALL_S = 90
"""`gpu-install.sh`: the bundle's wheels and this package installed, the sources unpacked."""
PREPARE_S = 60
"""`gpu-pair-bench.sh prepare`: the reference wheels installed, the GGUF joined and converted."""
STASH_S = 20
"""`gpu-pair-bench.sh stash`: one call's folder copied into the stash."""

BUNDLE_DIR = ".gpu-bundle"
BUNDLE_BOUND_BYTES = 30 * MIB
"""The bundle: SGLang's trimmed sources (9.6 MiB as tar.gz) and the wheels of requirements/gpu-bundle.txt
(about 18.5 MiB); its manifest.json records the exact bytes."""
CARRY_DIR = ".gpu-carry"
GGUF_XZ_BOUND_BYTES = 90_000_000
"""The demo target's GGUF (98 MB) compressed with xz, at most."""
CALL_ONE_EXTRAS_BOUND_BYTES = 4 * MIB
"""call-1's wheels (requirements/gpu-reference.txt) and prompts.jsonl, at most."""

BENCH = "python3 -m bastion_sglang.cli bench"
CALIBRATE = "python3 -m bastion_sglang.cli calibrate"
SGLANG_ENV = "export PYTHONPATH=/tmp/sglang-src SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1"
DEMO_TARGET = "/tmp/bastion-cache/smollm2-135m-instruct"
DEMO_DRAFTER = "models/smollm2-135m-instruct-dflash"
PROMPTS = "/tmp/bastion-carry/prompts.jsonl"
QWEN3_8B_CONFIG = "tools/offline_gpu/models/qwen3-8b"
QWEN3_8B_DRAFTER = "/tmp/qwen3-8b-dflash-b16"
QWEN3_8B_PROFILE = f"docs/benchmarks/{PUBLISHED_PROFILES['qwen3-8b-dummy-calibrate'][1]}"
DFLASH_ACCEPTANCE = "tools/offline_gpu/profiles/qwen3-8b-dflash-b16-gsm8k.json"
"""The synthetic acceptance profile of z-lab's Qwen3-8B-DFlash-b16 on GSM8K (written by fit_acceptance.py)."""
CONCURRENCIES = (1, 8, 32)
DEMO_NUM_PROMPTS = {1: 8, 8: 16, 32: 64}
"""Prompts per demo-pair bench run at each concurrency (two full batches at 32)."""


@dataclass(frozen=True)
class BuildStep:
    """A step run here, before the machine is lent, that builds folders a command carries.

    command: run from the repository root. outputs: the folders it writes (relative paths).
    """

    name: str
    command: str
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Carried:
    """A folder carried with a command: where it lies, the step that builds it, its bytes.

    recorded: True when `size_bytes` was measured on the built folder here, False when it is the bound.
    """

    path: str
    build: str
    size_bytes: int
    recorded: bool


@dataclass(frozen=True)
class GpuCommand:
    """One call on the GPU machine.

    run: the command line there (from the repository root). needs: repository files the command line
    names (scripts, configs), checked to exist unless listed in the item's `missing`. limit_s, expected_s:
    seconds.
    """

    name: str
    carry: tuple[Carried, ...]
    run: str
    needs: tuple[str, ...]
    limit_s: int
    expected_s: int

    def carried_bytes(self, repository_bytes: int) -> int:
        """What the call carries in all: the repository's files and the folders."""
        return repository_bytes + sum(folder.size_bytes for folder in self.carry)


@dataclass(frozen=True)
class Item:
    """A measurement made in one lending of a GPU machine: its commands run back to back.

    missing: what a command needs that the repository does not have yet (a flag, a file); checked
    against `MISSING_ALLOWED` by the tests, so nobody mistakes the item for ready.
    """

    name: str
    title: str
    builds: tuple[BuildStep, ...]
    commands: tuple[GpuCommand, ...]
    missing: tuple[str, ...] = ()

    @property
    def expected_minutes(self) -> float:
        """Start-up, then every call's transfer and expected run time."""
        calls = sum(CALL_OVERHEAD_S + command.expected_s for command in self.commands)
        return (STARTUP_S + calls) / 60


@dataclass(frozen=True)
class Sizes:
    """What the plan knows of the carried sizes: the repository, the bundle, each carry call folder."""

    repository_bytes: int
    bundle: Carried
    carry_calls: tuple[Carried, ...]


BUILD_BUNDLE = BuildStep("bundle", "tools/offline_gpu/gpu-bundle.sh", (BUNDLE_DIR,))
BUILD_CARRY = BuildStep("carry", "tools/offline_gpu/gpu-pair-bench.sh pack", (CARRY_DIR,))


def carry_call_bound(repository_bytes: int) -> int:
    """What `gpu_carry.pack` lets one call folder hold beside the repository (it refuses more)."""
    return CALL_LIMIT_BYTES - repository_bytes - MARGIN_BYTES


def estimated_carry_calls(repository_bytes: int) -> int:
    """Call folders `pack` makes for the GGUF at its bound size (call-1 also holds the wheels and prompts)."""
    room = carry_call_bound(repository_bytes) - MANIFEST_RESERVE_BYTES
    rest = GGUF_XZ_BOUND_BYTES - (room - CALL_ONE_EXTRAS_BOUND_BYTES)
    return 1 + max(0, math.ceil(rest / room))


def carry_call_bounds(repository_bytes: int) -> list[int]:
    """Upper bounds of the call folders `pack` makes: every folder but the last holds at most what a call
    allows; the last, the rest of the GGUF's bound after the others were filled (call-1 with its wheels and
    prompts at their bound), plus its carry.json."""
    calls = estimated_carry_calls(repository_bytes)
    full = carry_call_bound(repository_bytes)
    room = full - MANIFEST_RESERVE_BYTES
    if calls == 1:
        return [full]
    rest = GGUF_XZ_BOUND_BYTES - (room - CALL_ONE_EXTRAS_BOUND_BYTES) - (calls - 2) * room
    return [full] * (calls - 1) + [rest + MANIFEST_RESERVE_BYTES]


def checkout_sizes(root: Path = REPO_ROOT) -> Sizes:
    """The sizes of this checkout: the bundle's manifest and the carry folders when built, else bounds."""
    from offline_gpu.gpu_carry import repository_bytes

    repo = repository_bytes(root)
    manifest = root / BUNDLE_DIR / BUNDLE_MANIFEST
    if manifest.is_file():
        bundle = Carried(BUNDLE_DIR, BUILD_BUNDLE.name, folder_bytes(root / BUNDLE_DIR), recorded=True)
    else:
        bundle = Carried(BUNDLE_DIR, BUILD_BUNDLE.name, BUNDLE_BOUND_BYTES, recorded=False)
    carry_manifest = root / CARRY_DIR / "call-1" / MANIFEST_NAME
    if carry_manifest.is_file():
        calls = json.loads(carry_manifest.read_text())["calls"]
        folders = [f"{CARRY_DIR}/call-{k}" for k in range(1, calls + 1)]
        carry = tuple(Carried(path, BUILD_CARRY.name, folder_bytes(root / path), True) for path in folders)
    else:
        carry = tuple(
            Carried(f"{CARRY_DIR}/call-{k}", BUILD_CARRY.name, bound, recorded=False)
            for k, bound in enumerate(carry_call_bounds(repo), start=1)
        )
    return Sizes(repo, bundle, carry)


def head_commit(root: Path = REPO_ROOT) -> str:
    """HEAD's short hash, with "+dirty" when tracked files differ from it."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
    return commit + ("+dirty" if dirty else "")


def recorded(item: str, name: str, commit: str, inner: str) -> str:
    """`inner` (a bash command line) run through record.py into $OUT/<name>."""
    return (
        f'python3 tools/offline_gpu/record.py --out "$OUT/{name}" --item {item} --name {name} '
        f"--commit {commit} -- bash -c {shlex.quote('set -euo pipefail; ' + inner)}"
    )


def _setup_commands(
    item: str, commit: str, sizes: Sizes, first: str, first_s: int, needs: tuple[str, ...], demo_target: bool
) -> list[GpuCommand]:
    """The calls that install SGLang (and, with `demo_target`, stash and convert the demo target); the last
    of them also runs `first` (expected `first_s` seconds)."""
    install = "tools/offline_gpu/gpu-install.sh"
    needs = ("tools/offline_gpu/gpu-install.sh", "tools/offline_gpu/record.py", *needs)
    if not demo_target:
        inner = f"{install} && {SGLANG_ENV} && {first}"
        return [
            GpuCommand(
                "install",
                (sizes.bundle,),
                recorded(item, "install", commit, inner),
                needs,
                MAX_LIMIT_S,
                INSTALL_S + first_s,
            )
        ]
    *stashed, last = sizes.carry_calls
    commands = [
        GpuCommand(
            f"stash-{k}",
            (folder,),
            recorded(item, f"stash-{k}", commit, f"tools/offline_gpu/gpu-pair-bench.sh stash {folder.path}"),
            ("tools/offline_gpu/gpu-pair-bench.sh", "tools/offline_gpu/record.py"),
            120,
            STASH_S,
        )
        for k, folder in enumerate(stashed, start=1)
    ]
    together = sizes.repository_bytes + last.size_bytes + sizes.bundle.size_bytes < CALL_LIMIT_BYTES
    if not together:
        commands.append(
            GpuCommand(
                "install", (sizes.bundle,), recorded(item, "install", commit, install), needs, 300, INSTALL_S
            )
        )
    prepare = f"tools/offline_gpu/gpu-pair-bench.sh prepare {last.path}"
    inner = f"{install + ' && ' if together else ''}{prepare} && {SGLANG_ENV} && {first}"
    carry = (last, sizes.bundle) if together else (last,)
    expected = (INSTALL_S if together else 0) + PREPARE_S + first_s
    commands.append(
        GpuCommand(
            "prepare",
            carry,
            recorded(item, "prepare", commit, inner),
            (*needs, "tools/offline_gpu/gpu-pair-bench.sh"),
            MAX_LIMIT_S,
            expected,
        )
    )
    return commands


def demo_bench(concurrency: int, policies: str, overlap: str, out: str) -> str:
    """`bastion bench` of the demo pair at one concurrency (T = 0 and 0.7, 2 repeats) into $RESULTS/<out>."""
    return (
        f"{BENCH} --model-path {DEMO_TARGET} --draft-model-path {DEMO_DRAFTER} --prompts {PROMPTS} "
        f"--num-prompts {DEMO_NUM_PROMPTS[concurrency]} --max-new-tokens 128 --ignore-eos "
        f"--temperatures 0,0.7 --repeats 2 --concurrency {concurrency} --max-budget 256 "
        f"--policies {policies} --bastion-overlap-schedule {overlap} --out $RESULTS/{out}"
    )


def sglang_cuda(commit: str, sizes: Sizes) -> Item:
    pytest = "python3 -m pytest -q tests/gpu --junitxml $RESULTS/junit.xml"
    commands = _setup_commands("sglang-cuda", commit, sizes, pytest, 240, ("tests/gpu",), demo_target=True)
    launch = (
        f"{SGLANG_ENV} && python3 tools/offline_gpu/serve_once.py --target {DEMO_TARGET} "
        "--log $RESULTS/server.log --max-tokens 64"
    )
    commands.append(
        GpuCommand(
            "launch",
            (),
            recorded("sglang-cuda", "launch", commit, launch),
            ("tools/offline_gpu/serve_once.py", DEMO_DRAFTER),
            420,
            150,
        )
    )
    return Item(
        "sglang-cuda",
        "SGLang serves on CUDA: the bundle installs, tests/gpu passes with SGLang present, the README's "
        "launch line (no --attention-backend) starts and answers one request",
        (BUILD_CARRY, BUILD_BUNDLE),
        tuple(commands),
    )


def demo_pair(commit: str, sizes: Sizes, concurrency: int, half: str) -> Item:
    """Half "a": ar, dflash, chain, fixed:16; half "b": ar, fixed:64, fixed:256, adaptive, then adaptive
    under the overlap scheduler (same machine, so the overlap comparison is within one lending)."""
    name = f"demo-pair-c{concurrency}-{half}"
    first_policies = "ar,dflash,chain,fixed:16" if half == "a" else "ar,fixed:64,fixed:256,adaptive"
    first = demo_bench(concurrency, first_policies, "off", "bench-off")
    commands = _setup_commands(name, commit, sizes, first, 8 * DEMO_ENGINE_RUN_S, (DEMO_DRAFTER,), True)
    if half == "b":
        overlap = f"{SGLANG_ENV} && {demo_bench(concurrency, 'adaptive', 'on', 'bench-overlap-on')}"
        commands.append(
            GpuCommand(
                "overlap-on",
                (),
                recorded(name, "overlap-on", commit, overlap),
                (DEMO_DRAFTER,),
                300,
                2 * DEMO_ENGINE_RUN_S,
            )
        )
    title = (
        f"bastion bench in SGLang on the GPU, demo pair, concurrency {concurrency}, T = 0 and 0.7, "
        "2 repeats: "
        + (
            "ar, dflash (SGLang's own), chain, fixed:16"
            if half == "a"
            else "ar, fixed:64, fixed:256, adaptive with overlap off, adaptive with overlap on"
        )
    )
    return Item(name, title, (BUILD_CARRY, BUILD_BUNDLE), tuple(commands))


ASSEMBLE_DFLASH2 = (
    "DFLASH2=$(python3 -c "
    '"from bastion_sglang.demo.drafters import assemble_dflash2; print(assemble_dflash2())")'
)
"""Writes the demo DFlash2 drafter's complete checkpoint (backbone and selector) and names its folder."""


def demo_dflash2_pair(commit: str, sizes: Sizes, concurrency: int) -> Item:
    """The demo DFlash2 pair at one concurrency: ar, SGLang's own DFlash2 chain (`dflash`), BASTION's lattice
    chain, fixed:16 lattice trees and adaptive."""
    name = f"demo-dflash2-pair-c{concurrency}"
    bench = demo_bench(concurrency, "ar,dflash,chain,fixed:16,adaptive", "off", "bench-off")
    bench = bench.replace(f"--draft-model-path {DEMO_DRAFTER}", "--draft-model-path $DFLASH2")
    needs = (DEMO_DRAFTER, "models/smollm2-135m-instruct-dflash2")
    first = f"{ASSEMBLE_DFLASH2} && {bench}"
    commands = _setup_commands(name, commit, sizes, first, 10 * DEMO_ENGINE_RUN_S, needs, demo_target=True)
    title = (
        f"bastion bench in SGLang on the GPU, demo DFlash2 pair, concurrency {concurrency}, T = 0 and 0.7, "
        "2 repeats: ar, dflash (SGLang's DFlash2 chain), BASTION's lattice chain, fixed:16, adaptive"
    )
    return Item(name, title, (BUILD_CARRY, BUILD_BUNDLE), tuple(commands))


STARTUP_CALIBRATE_S = 300
"""`bastion calibrate --engine sglang` of the demo pair on the GPU (7 widths × 7 contexts, 5 repeats) with its
acceptance run on 24 prompts, then `benchmarks/startup_calibration.py`: three Engine starts and the held-out
acceptance decode on the reference engine."""


def demo_startup_calibration(commit: str, sizes: Sizes) -> Item:
    """The server's start-up calibration on the GPU against `bastion calibrate` of the same pair: seconds
    added to the start, latency MAPE on calibrate's grid, acceptance on held-out prompts."""
    name = "demo-startup-calibration"
    calibrate = (
        f"{CALIBRATE} --engine sglang --device cuda --model-path {DEMO_TARGET} --draft-model-path "
        f"{DEMO_DRAFTER} --dtype float32 --widths 2 4 8 16 32 64 65 --max-context 4096 --repeats 5 "
        "--acceptance-num-prompts 24 --out $RESULTS/calibrate.json"
    )
    startup = (
        f"python3 benchmarks/startup_calibration.py --calibrate-profile $RESULTS/calibrate.json "
        f"--model-path {DEMO_TARGET} --draft-model-path {DEMO_DRAFTER} --out $RESULTS/startup.json"
    )
    needs = (DEMO_DRAFTER, "benchmarks/startup_calibration.py")
    commands = _setup_commands(
        name, commit, sizes, f"{calibrate} && {startup}", STARTUP_CALIBRATE_S, needs, demo_target=True
    )
    title = (
        "start-up calibration of the demo pair in SGLang on the GPU (captured verify graphs) against "
        "bastion calibrate: seconds added to the start, latency MAPE on calibrate's grid, acceptance"
    )
    return Item(name, title, (BUILD_CARRY, BUILD_BUNDLE), tuple(commands))


STEP_ANATOMY_S = 420
"""`bastion step-anatomy --sites` of the demo pair on the GPU: three Engines (ar, adaptive, fixed:16), each
started with its CUDA graphs, one warm-up request and a batch of 1 and of 8 of 64 tokens."""


def demo_step_anatomy(commit: str, sizes: Sizes) -> Item:
    """The CUDA column of the step anatomy: ops (kernel launches) and blocking syncs per region of SGLang's
    plain decode step and of BASTION's skipped, declined and speculative steps, with the line of each."""
    name = "demo-step-anatomy"
    anatomy = (
        f"python3 -m bastion_sglang.cli step-anatomy --model-path {DEMO_TARGET} --draft-model-path "
        f"{DEMO_DRAFTER} --policies ar,adaptive,fixed:16 --concurrency 1,8 --max-new-tokens 64 "
        "--dtype float32 --sites --out $RESULTS/anatomy"
    )
    commands = _setup_commands(
        name, commit, sizes, anatomy, STEP_ANATOMY_S, (DEMO_DRAFTER,), demo_target=True
    )
    title = (
        "step anatomy of the demo pair in SGLang on the GPU: kernel launches and blocking syncs per region "
        "of a plain, skipped, declined and speculative step, with their call sites"
    )
    return Item(name, title, (BUILD_CARRY, BUILD_BUNDLE), tuple(commands))


QWEN3_8B_DUMMY = f"--model-path {QWEN3_8B_CONFIG} --load-format dummy"
MAKE_DRAFTER = (
    f"python3 benchmarks/calibrate_gpu.py --make-drafter {QWEN3_8B_DRAFTER} --target-config {QWEN3_8B_CONFIG}"
)


QWEN3_8B_PROMPTS = {1: 16, 8: 64, 32: 64}
"""Random prompts per Qwen3-8B bench run at each concurrency: at c1 16 (2048 tokens, about 15 s of plain
decoding), else 64 (8 batches at c8, 2 at c32)."""


def qwen3_8b_anatomy(concurrency: int, policies: str) -> str:
    """`bastion bench` of the dummy-weight pair: its "ms per decode step" table is the stage anatomy (draft,
    plan, verify, accept, commit, other) of each policy at this concurrency."""
    return (
        f"{BENCH} {QWEN3_8B_DUMMY} --draft-model-path {QWEN3_8B_DRAFTER} "
        f"--random-prompts {QWEN3_8B_PROMPTS[concurrency]} "
        f"--max-new-tokens 128 --ignore-eos --temperatures 0 --repeats 1 --concurrency {concurrency} "
        f"--max-budget 256 --policies {policies} --out $RESULTS/anatomy-c{concurrency}"
    )


QWEN3_8B_OPS = (
    f"python3 -m bastion_sglang.cli step-anatomy {QWEN3_8B_DUMMY} --draft-model-path {QWEN3_8B_DRAFTER} "
    "--random-prompts 32 --policies ar,chain,adaptive --concurrency 1,8,32 --max-new-tokens 32 "
    "--max-budget 256 --out $RESULTS/ops"
)
"""`bastion step-anatomy` of the dummy-weight pair: kernel launches and blocking syncs per region of each
step kind of ar, chain and adaptive at concurrency 1, 8 and 32."""


def qwen3_8b_dummy(commit: str, sizes: Sizes, part: str) -> Item:
    """Part "calibrate": `bastion calibrate --engine sglang` (eager verify passes); "anatomy-c1-c8" and
    "anatomy-c32": the step anatomy of ar, chain and adaptive (stage times from `bastion bench`, and with c32
    the ops and syncs of `bastion step-anatomy` at every concurrency)."""
    name = f"qwen3-8b-dummy-{part}"
    needs = (f"{QWEN3_8B_CONFIG}/config.json", "benchmarks/calibrate_gpu.py")
    if part == "calibrate":
        calibrate = (
            f"{CALIBRATE} --engine sglang --device cuda {QWEN3_8B_DUMMY} --draft-model-path "
            f"{QWEN3_8B_DRAFTER} --no-acceptance --max-width 1024 --max-context 8192 --repeats 5 "
            "--out $RESULTS/profile.json"
        )
        first, first_s = f"{MAKE_DRAFTER} && {calibrate}", 420
        rest: list[GpuCommand] = []
    else:
        concurrencies = (1, 8) if part == "anatomy-c1-c8" else (32,)
        runs = [qwen3_8b_anatomy(c, "ar,chain,adaptive") for c in concurrencies]
        labels = [f"anatomy-c{c}" for c in concurrencies[1:]]
        if part == "anatomy-c32":
            runs.append(QWEN3_8B_OPS)
            labels.append("ops")
        first, first_s = f"{MAKE_DRAFTER} && {runs[0]}", 60 + 3 * QWEN3_8B_ENGINE_RUN_S
        rest = [
            GpuCommand(
                label,
                (),
                recorded(name, label, commit, f"{SGLANG_ENV} && {run}"),
                needs,
                MAX_LIMIT_S,
                3 * QWEN3_8B_ENGINE_RUN_S,
            )
            for label, run in zip(labels, runs[1:], strict=True)
        ]
    commands = _setup_commands(name, commit, sizes, first, first_s, needs, demo_target=False) + rest
    title = (
        "8B-shaped target without weights (Qwen3-8B config, --load-format dummy) and a random "
        "Qwen3-8B-DFlash-b16-shaped drafter: "
        + (
            "bastion calibrate --engine sglang (eager verify passes)"
            if part == "calibrate"
            else f"step anatomy of ar, chain and adaptive at {part.removeprefix('anatomy-')}"
        )
    )
    return Item(name, title, (BUILD_BUNDLE,), tuple(commands))


SYNTHETIC_POLICIES = "ar,chain,fixed:64,adaptive"


def qwen3_8b_synthetic(commit: str, sizes: Sizes, part: str) -> Item:
    """Part "c1", "c8" or "c32" (one concurrency per lending: four Engines of an 8B target fill one):
    `bastion bench` of ar, chain, fixed:64 and adaptive on the dummy-weight pair, the BASTION Engines planning
    with the calibrate item's profile and accepting by the published GSM8K profile
    (`--synthetic-acceptance`)."""
    name = f"qwen3-8b-synthetic-{part}"
    needs = (f"{QWEN3_8B_CONFIG}/config.json", "benchmarks/calibrate_gpu.py")
    needs += (QWEN3_8B_PROFILE, DFLASH_ACCEPTANCE)

    def bench(concurrency: int) -> str:
        return (
            f"{BENCH} {QWEN3_8B_DUMMY} --draft-model-path {QWEN3_8B_DRAFTER} "
            f"--random-prompts {QWEN3_8B_PROMPTS[concurrency]} --max-new-tokens 128 --ignore-eos "
            f"--temperatures 0 --repeats 1 --concurrency {concurrency} --max-budget 256 "
            f"--policies {SYNTHETIC_POLICIES} --bastion-profile {QWEN3_8B_PROFILE} "
            f"--synthetic-acceptance {DFLASH_ACCEPTANCE} --out $RESULTS/synthetic-c{concurrency}"
        )

    engines_s = len(SYNTHETIC_POLICIES.split(",")) * QWEN3_8B_ENGINE_RUN_S
    first = f"{MAKE_DRAFTER} && {bench(int(part.removeprefix('c')))}"
    commands = _setup_commands(name, commit, sizes, first, 60 + engines_s, needs, False)
    missing = (f"{QWEN3_8B_PROFILE} (ingested from qwen3-8b-dummy-calibrate)",)
    title = (
        "trees at real 8B step costs (the qwen3-8b-dummy profile) with the published acceptance of z-lab's "
        f"Qwen3-8B-DFlash-b16 on GSM8K (synthetic): {SYNTHETIC_POLICIES} at {part}"
    )
    return Item(name, title, (BUILD_BUNDLE,), tuple(commands), missing)


def controller_bench(commit: str, sizes: Sizes) -> Item:
    bench = "python3 -m bastion_sglang.controller.bench --device cuda --out $RESULTS/controller_bench.json"
    commands = _setup_commands("controller-bench", commit, sizes, bench, 120, ("controller/bench.py",), False)
    return Item(
        "controller-bench",
        "the controller bench (bastion_sglang.controller.bench, source controller/bench.py) on the GPU host",
        (BUILD_BUNDLE,),
        tuple(commands),
    )


MISSING_ALLOWED = frozenset(
    {
        f"{QWEN3_8B_PROFILE} (ingested from qwen3-8b-dummy-calibrate)",
    }
)
"""Everything an item may list as missing: remove an entry when it lands, add one only with its item."""


def all_items(commit: str, sizes: Sizes) -> tuple[Item, ...]:
    """Every item, in the order they are to be run."""
    return (
        sglang_cuda(commit, sizes),
        *(demo_pair(commit, sizes, c, half) for c in CONCURRENCIES for half in ("a", "b")),
        demo_startup_calibration(commit, sizes),
        demo_step_anatomy(commit, sizes),
        *(demo_dflash2_pair(commit, sizes, c) for c in (1, 8)),
        *(qwen3_8b_dummy(commit, sizes, part) for part in ("calibrate", "anatomy-c1-c8", "anatomy-c32")),
        *(qwen3_8b_synthetic(commit, sizes, f"c{c}") for c in CONCURRENCIES),
        controller_bench(commit, sizes),
    )


def _mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


def format_item(item: Item, sizes: Sizes) -> str:
    """The item as printed by `plan`: build steps, missing pieces, then each command with its carry."""
    lines = [
        f"item {item.name}: {item.title}",
        f"expected: {item.expected_minutes:.1f} min of GPU time (start-up {STARTUP_S / 60:.0f} min and "
        f"{CALL_OVERHEAD_S} s per call included; limit {MAX_ITEM_MINUTES:.0f})",
        "build here first:",
        *(f"  {step.command}    # -> {', '.join(step.outputs)}" for step in item.builds),
        f"missing: {'; '.join(item.missing) if item.missing else 'nothing'}",
        f"then, on the machine, back to back ({len(item.commands)} calls):",
    ]
    for number, command in enumerate(item.commands, start=1):
        folders = ", ".join(
            f"{folder.path} ({_mib(folder.size_bytes)} {'measured' if folder.recorded else 'bound'})"
            for folder in command.carry
        )
        lines += [
            f"{number}. {command.name}: carry {folders or 'nothing but the repository'}; "
            f"{_mib(command.carried_bytes(sizes.repository_bytes))} with the repository "
            f"({_mib(sizes.repository_bytes)}) of {_mib(CALL_LIMIT_BYTES)}; time limit {command.limit_s} s; "
            f"expected {command.expected_s} s",
            f"   {command.run}",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/offline_gpu/plan",
        description="Print the commands of an offline GPU item: what to build here, what each call carries, "
        "the command line there, its time limit and the item's expected minutes.",
    )
    parser.add_argument("item", nargs="?", help="the item (see --list)")
    parser.add_argument("--list", action="store_true", help="list the items in the order to run them")
    args = parser.parse_args(argv)
    sizes = checkout_sizes()
    items = {item.name: item for item in all_items(head_commit(), sizes)}
    if args.list or args.item is None:
        for item in items.values():
            ready = "ready" if not item.missing else f"missing {len(item.missing)}"
            print(f"{item.name:28} {item.expected_minutes:5.1f} min  {ready}")
        return 0
    if args.item not in items:
        print(f"error: no item {args.item!r}; items: {', '.join(items)}", file=sys.stderr)
        return 2
    print(format_item(items[args.item], sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
