"""Build the folder that carries SGLang to a GPU machine with no network and no SGLang.

The folder (default `.gpu-bundle/`, git-ignored) holds:
- `sglang-src.tar.gz`: SGLang's Python sources trimmed to what serving a dense Llama/Qwen3 target with
  BASTION needs (`trim_sglang`), unpacked there and put on PYTHONPATH;
- `wheels/`: the cp312 manylinux wheels of SGLang's dependencies that the GPU image lacks, pinned in
  `requirements/gpu-bundle.txt` (`download_wheels`), installed there with `pip install --no-index`;
- `manifest.json`: what was kept and dropped, with sizes (`BundleReport`).

What the trim drops and why (checked by `tests/offline_gpu/test_gpu_bundle.py`, which imports the serving path
from a trimmed tree):
- compiled extensions (`*.so`): the Rust HTTP/gRPC servers, benchmarks and multimodal helpers are off
  the serving path, and without the Rust TreeCore SGLang selects its Python TreeCore
  (`mem_cache/unified_cache/tree_core_registry.py`); they are built for one Python version anyway;
- `multimodal_gen/` (the diffusion generator), `test/` and `benchmark/` but `benchmark/one_batch.py`:
  never imported by the server (`one_batch` is: the prefill of calibration's measurement engine, which
  `bastion calibrate --engine sglang` and a server's start-up calibration run);
- model files other than `KEPT_MODELS`: SGLang's model registry imports every module of
  `sglang.srt.models` and skips those that are absent, so only the architectures kept can be served.

What the trim replaces (`STANDIN_MODULES`): modules the serving path imports on CUDA whose imports the GPU
image cannot satisfy, each by a few lines that give what the serving path reads from it (found on the first
CUDA run, 2026-11-27, H200):
- `kernels/ops/gemm/cutedsl_dual_gemm.py` imports `cutlass` (NVIDIA's CUTLASS DSL) at module level, and every
  dense MLP's `DualGemm` imports it on CUDA to ask `can_use_dual_gemm`; the kernel runs on SM100 only, so on
  the H100/H200 the answer is False either way, which the stand-in gives;
- `srt/models/deepseek_v2.py` (dropped with the other models) is imported by the DeepSeek-V4 attention
  modules that SGLang's decode CUDA-graph runner imports while capturing, for two flags (`_is_hip`,
  `_use_aiter`), which the stand-in computes as SGLang does.

`tools/offline_gpu/gpu-bundle.sh --help` (`python -m offline_gpu.gpu_bundle` with `tools/` on PYTHONPATH)
builds it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from offline_gpu import REPO_ROOT

SGLANG_VERSION = "0.5.23"
PYTHON_VERSION = "3.12"
"""The GPU image's Python (its wheels must be cp312 or pure Python)."""
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
"""Platform tags pip may pick for the dependency wheels (x86-64, glibc >= 2.28), as the device notes say."""
SGLANG_PLATFORMS = ("manylinux_2_34_x86_64", *PLATFORMS)
"""SGLang's wheel is tagged manylinux_2_34; only its Python sources are kept, so the tag does not matter."""

WHEEL_REQUIREMENTS = REPO_ROOT / "requirements" / "gpu-bundle.txt"
SOURCES_ARCHIVE = "sglang-src.tar.gz"
WHEELS_DIR = "wheels"
MANIFEST = "manifest.json"

DROPPED_PACKAGES = ("multimodal_gen", "test", "benchmark")
"""Subpackages of `sglang` that the server never imports (but `KEPT_BENCHMARK`)."""
KEPT_BENCHMARK = frozenset({"__init__.py", "one_batch.py"})
"""Files of `sglang/benchmark/` kept: the one-batch prefill calibration's measurement engine uses."""
STANDIN_MODULES: dict[str, str] = {
    "kernels/ops/gemm/cutedsl_dual_gemm.py": '''"""Offline GPU bundle stand-in: SGLang's SM100 dual GEMM
needs the CUTLASS DSL, which this machine lacks; on other GPUs `can_use_dual_gemm` is False, as here."""

from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens, hidden_size, intermediate_size, quant_mode) -> bool:
    return False
''',
    "srt/models/deepseek_v2.py": '''"""Offline GPU bundle stand-in for the dropped DeepSeek-V2 model:
the two flags SGLang's DeepSeek-V4 attention modules import from it while decode graphs are captured."""

from sglang.srt.utils import get_bool_env_var, is_hip

_is_hip = is_hip()
_use_aiter = get_bool_env_var("SGLANG_USE_AITER") and _is_hip
''',
}
"""Files of `sglang/` the trim writes in place of the originals (module docstring), by path inside it."""
DROPPED_SUFFIXES = (".so", ".pyc")
MODELS_PACKAGE = ("srt", "models")
KEPT_MODELS = frozenset(
    {
        "__init__",
        "registry",
        "utils",
        "transformers",
        "llama",
        "qwen2",
        "qwen3",
        "dflash",
        # Imported by the modules above (model-family helpers shared between text and VL/MoE variants).
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_omni_moe",
        "qwen3_asr",
    }
)
"""Modules of `sglang.srt.models` kept: the model registry and shared utilities, the dense Llama and
Qwen2/Qwen3 targets, the DFlash drafter (BASTION's draft model), what they import, and SGLang's generic
Transformers fallback (`TransformersForCausalLM`). Model subpackages are dropped."""


@dataclass(frozen=True)
class TrimReport:
    """What `trim_sglang` copied and skipped (bytes are file sizes on disk)."""

    kept_files: int
    kept_bytes: int
    dropped_files: int
    dropped_bytes: int


@dataclass(frozen=True)
class BundleReport:
    """The bundle's parts and sizes, written to `manifest.json`."""

    sglang_version: str
    trim: TrimReport
    sources_archive_bytes: int
    wheels: tuple[str, ...]
    wheels_bytes: int
    total_bytes: int


def is_dropped(relative: Path) -> bool:
    """Whether the trim leaves out the file at `relative` (a path inside the `sglang` package)."""
    parts = relative.parts
    if "__pycache__" in parts or relative.suffix in DROPPED_SUFFIXES:
        return True
    if parts[0] in DROPPED_PACKAGES:
        return not (parts[0] == "benchmark" and len(parts) == 2 and parts[1] in KEPT_BENCHMARK)
    if parts[: len(MODELS_PACKAGE)] == MODELS_PACKAGE and len(parts) > len(MODELS_PACKAGE):
        inside = parts[len(MODELS_PACKAGE) :]
        return len(inside) > 1 or Path(inside[0]).stem not in KEPT_MODELS
    return False


def trim_sglang(package: Path, dest: Path) -> TrimReport:
    """Copy the `sglang` package directory `package` to `dest/sglang`, leaving out what `is_dropped` says and
    writing `STANDIN_MODULES` in place of their originals.

    `package` is an installed or unpacked `sglang/` folder; `dest` must not contain `sglang` yet.
    """
    if not (package / "__init__.py").is_file() or package.name != "sglang":
        raise ValueError(f"{package} is not an sglang package directory (sglang/__init__.py)")
    target = dest / "sglang"
    if target.exists():
        raise FileExistsError(f"{target} exists; trim into an empty folder")
    kept = dropped = kept_bytes = dropped_bytes = 0
    for path in sorted(package.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(package)
        size = path.stat().st_size
        if is_dropped(relative):
            dropped += 1
            dropped_bytes += size
            continue
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / relative)
        kept += 1
        kept_bytes += size
    for relative, text in STANDIN_MODULES.items():
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        (target / relative).write_text(text)
    return TrimReport(kept, kept_bytes, dropped, dropped_bytes)


def archive_tree(root: Path, archive: Path) -> int:
    """Write `root`'s contents to the gzip tarball `archive` (paths relative to `root`); returns its bytes."""
    with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name)
    return archive.stat().st_size


def _pip_download(args: list[str], dest: Path, platforms: tuple[str, ...] = PLATFORMS) -> None:
    """`pip download` cp312 binaries for `platforms` only (no dependency resolution) into `dest`."""
    platform_flags = [flag for tag in platforms for flag in ("--platform", tag)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", PYTHON_VERSION, "--implementation", "cp", *platform_flags]
    command += ["-d", str(dest)]
    subprocess.run([*command, *args], check=True)


def fetch_sglang_package(workdir: Path) -> Path:
    """Download SGLang's cp312 wheel into `workdir` and unpack it; returns the unpacked `sglang/` folder."""
    _pip_download([f"sglang=={SGLANG_VERSION}"], workdir, SGLANG_PLATFORMS)
    (wheel,) = workdir.glob(f"sglang-{SGLANG_VERSION}-*.whl")
    unpacked = workdir / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    return unpacked / "sglang"


def download_wheels(dest: Path, requirements: Path = WHEEL_REQUIREMENTS) -> tuple[str, ...]:
    """Download the pinned wheels of `requirements` into `dest`; returns their file names."""
    dest.mkdir(parents=True, exist_ok=True)
    _pip_download(["-r", str(requirements)], dest)
    return tuple(sorted(path.name for path in dest.glob("*.whl")))


def folder_bytes(folder: Path) -> int:
    """Total size of the files under `folder` (or of `folder` itself when it is a file)."""
    if folder.is_file():
        return folder.stat().st_size
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def build_bundle(out: Path, sglang_package: Path | None, with_wheels: bool = True) -> BundleReport:
    """Build the bundle in `out` (replaced if present) and return its report.

    sglang_package: an `sglang/` folder to trim (e.g. the installed one); None downloads SGLang's wheel.
    with_wheels: False skips the dependency wheels (no network needed when `sglang_package` is given).
    """
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as scratch:
        scratch_dir = Path(scratch)
        package = sglang_package if sglang_package is not None else fetch_sglang_package(scratch_dir)
        trimmed = scratch_dir / "trimmed"
        trim = trim_sglang(package, trimmed)
        archive_bytes = archive_tree(trimmed, out / SOURCES_ARCHIVE)
    wheels = download_wheels(out / WHEELS_DIR) if with_wheels else ()
    wheels_bytes = folder_bytes(out / WHEELS_DIR) if with_wheels else 0
    report = BundleReport(
        SGLANG_VERSION, trim, archive_bytes, wheels, wheels_bytes, archive_bytes + wheels_bytes
    )
    (out / MANIFEST).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m offline_gpu.gpu_bundle",
        description="Build the folder carrying trimmed SGLang sources and missing wheels to the GPU machine.",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".gpu-bundle", help="bundle folder")
    parser.add_argument(
        "--sglang-package",
        type=Path,
        default=None,
        help=f"an sglang/ folder to trim (default: download SGLang {SGLANG_VERSION}'s cp312 wheel)",
    )
    parser.add_argument("--skip-wheels", action="store_true", help="do not download the dependency wheels")
    args = parser.parse_args(argv)
    report = build_bundle(args.out, args.sglang_package, with_wheels=not args.skip_wheels)
    trim = report.trim
    print(
        f"sglang {report.sglang_version} sources: kept {trim.kept_files} files ({_mib(trim.kept_bytes)}), "
        f"dropped {trim.dropped_files} ({_mib(trim.dropped_bytes)}); "
        f"{SOURCES_ARCHIVE}: {_mib(report.sources_archive_bytes)}"
    )
    print(f"{len(report.wheels)} wheels: {_mib(report.wheels_bytes)}")
    print(f"bundle {args.out}: {_mib(report.total_bytes)} ({report.total_bytes} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
