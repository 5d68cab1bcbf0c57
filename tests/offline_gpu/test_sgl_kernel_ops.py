"""BASTION's torch stand-ins for sglang-kernel: each equals a plain torch formula; the finder serves them
only where no real `sgl_kernel` is importable, only where its `.pth` file was written on purpose, and says
so once per process."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from offline_gpu import sgl_kernel_finder, sgl_kernel_ops

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("name", "act"),
    [
        ("silu_and_mul", lambda g: g * torch.sigmoid(g)),
        ("gelu_and_mul", lambda g: 0.5 * g * (1 + torch.erf(g / 2**0.5))),
        (
            "gelu_tanh_and_mul",
            lambda g: 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))),
        ),
    ],
)
def test_act_and_mul_matches_formula(name: str, act, dtype: torch.dtype) -> None:
    x = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = act(x[:, :24].double()) * x[:, 24:].double()
    fn = getattr(sgl_kernel_ops, name)
    out = torch.empty(5, 24, dtype=dtype)
    assert fn(x, out) is out  # SGLang passes `out` positionally
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(fn(x), out)


def test_act_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        sgl_kernel_ops.silu_and_mul(torch.ones(2, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_and_fused_add_match_formula(dtype: torch.dtype, gemma: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=generator).to(dtype)
    residual = torch.randn(4, 32, generator=generator).to(dtype)
    weight = torch.randn(32, generator=generator).to(dtype)
    scale = (1 + weight.double()) if gemma else weight.double()
    norm = sgl_kernel_ops.gemma_rmsnorm if gemma else sgl_kernel_ops.rmsnorm
    fused = sgl_kernel_ops.gemma_fused_add_rmsnorm if gemma else sgl_kernel_ops.fused_add_rmsnorm
    tol = TOLERANCE[dtype]

    torch.testing.assert_close(
        norm(x, weight, 1e-6).double(), _rms(x.double(), 1e-6) * scale, atol=tol, rtol=tol
    )
    summed = x.double() + residual.double()
    x_inout, residual_inout = x.clone(), residual.clone()
    assert fused(x_inout, residual_inout, weight, 1e-6) is None  # in place, like sglang-kernel
    torch.testing.assert_close(residual_inout.double(), summed, atol=tol, rtol=tol)
    torch.testing.assert_close(x_inout.double(), _rms(summed, 1e-6) * scale, atol=tol, rtol=tol)


def test_top_k_renorm_prob_on_literal_rows() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    kept = sgl_kernel_ops.top_k_renorm_prob(probs, torch.tensor([2, 8]))
    torch.testing.assert_close(kept, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7], [0.25, 0.25, 0.25, 0.25]]))
    torch.testing.assert_close(
        sgl_kernel_ops.top_k_renorm_prob(probs[:1], 1), torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    )


def test_top_p_renorm_prob_on_literal_rows() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]])
    # Sorted 0.4, 0.3, 0.2, 0.1: mass before each is 0, 0.4, 0.7, 0.9; kept while <= top_p.
    kept = sgl_kernel_ops.top_p_renorm_prob(probs, torch.tensor([0.5, 0.1]))
    torch.testing.assert_close(kept, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7], [0.0, 1.0, 0.0, 0.0]]))


def test_renorm_matches_sort_formula_on_random_rows() -> None:
    generator = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(6, 50, generator=generator), dim=-1)
    top_k = torch.tensor([1, 3, 10, 50, 7, 1 << 30])
    top_p = torch.tensor([0.05, 0.3, 0.6, 0.9, 0.99, 1.0])
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(50).expand(6, 50)
    expected_k = torch.where(ranks < top_k.view(-1, 1), sorted_probs, 0.0)
    expected_p = torch.where(sorted_probs.cumsum(-1) - sorted_probs <= top_p.view(-1, 1), sorted_probs, 0.0)
    for fn, limit, expected in (
        (sgl_kernel_ops.top_k_renorm_prob, top_k, expected_k),
        (sgl_kernel_ops.top_p_renorm_prob, top_p, expected_p),
    ):
        unsorted = torch.zeros_like(probs).scatter(-1, order, expected)
        torch.testing.assert_close(fn(probs, limit), unsorted / unsorted.sum(-1, keepdim=True))


def test_placeholders_import_and_raise_naming_the_function() -> None:
    names = sgl_kernel_ops.module_namespace("sgl_kernel.kvcacheio")
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.kvcacheio\.transfer_kv_per_layer"):
        names["transfer_kv_per_layer"]()
    with pytest.raises(ValueError, match="scalar_type"):
        sgl_kernel_ops.module_namespace("sgl_kernel.scalar_type")


@pytest.fixture
def clean_sgl_kernel() -> Iterator[None]:
    """No `sgl_kernel` modules before or after the test; the finder removed afterwards."""

    def forget() -> None:
        for name in [name for name in sys.modules if name.split(".")[0] == "sgl_kernel"]:
            del sys.modules[name]

    forget()
    yield
    sgl_kernel_finder.uninstall()
    forget()


@pytest.mark.usefixtures("clean_sgl_kernel")
def test_finder_serves_the_stand_ins_only_where_sgl_kernel_is_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=sgl_kernel_finder.__name__)
    sgl_kernel_finder.install("the test")
    sgl_kernel_finder.install("a second install")
    assert sum(isinstance(f, sgl_kernel_finder.SglKernelFallbackFinder) for f in sys.meta_path) == 1
    assert sys.meta_path[-1].__class__ is sgl_kernel_finder.SglKernelFallbackFinder

    from sgl_kernel import rmsnorm, silu_and_mul
    from sgl_kernel.utils import is_arch_support_pdl

    assert silu_and_mul is sgl_kernel_ops.silu_and_mul and rmsnorm is sgl_kernel_ops.rmsnorm
    assert is_arch_support_pdl() is False
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings  # once, though two modules were served
    assert "torch stand-in" in warnings[0] and "Installed by the test" in warnings[0]
    with pytest.raises(ImportError):
        from sgl_kernel.scalar_type import scalar_types  # noqa: F401  (SGLang falls back on ImportError)
    with pytest.raises(ImportError):
        from sgl_kernel import not_a_kernel  # noqa: F401

    for name in [name for name in sys.modules if name.split(".")[0] == "sgl_kernel"]:
        del sys.modules[name]
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sgl_kernel

    assert sgl_kernel.REAL is True


def _import_sgl_kernel(site: Path | None) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter of this environment imports `sgl_kernel`, after processing `site`'s `.pth` files
    (as site-packages would at start-up) when `site` is given."""
    setup = f"import site; site.addsitedir({str(site)!r}); " if site is not None else ""
    code = setup + "import sgl_kernel; sgl_kernel.silu_and_mul; print(sgl_kernel.__doc__)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_no_stand_in_without_the_pth_file() -> None:
    """This environment never ran gpu-install.sh: `sgl_kernel` is simply missing, no fallback appears."""
    result = _import_sgl_kernel(None)
    assert result.returncode != 0
    assert "No module named 'sgl_kernel'" in result.stderr


def test_pth_file_installs_the_finder_and_it_warns_once(tmp_path: Path) -> None:
    pth = sgl_kernel_finder.write_pth(tmp_path)
    assert pth == tmp_path / sgl_kernel_finder.PTH_NAME
    assert pth.read_text().splitlines()[0] == str(sgl_kernel_finder.TOOLS_DIR)
    result = _import_sgl_kernel(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "BASTION's torch stand-in for sgl_kernel" in result.stdout
    assert result.stderr.count("not sglang-kernel") == 1
    assert f"Installed by {pth}" in result.stderr

    assert sgl_kernel_finder.remove_pth(tmp_path) is True
    assert not pth.exists() and sgl_kernel_finder.remove_pth(tmp_path) is False
    assert "No module named 'sgl_kernel'" in _import_sgl_kernel(tmp_path).stderr
