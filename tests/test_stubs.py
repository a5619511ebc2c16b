"""The committed .pyi stubs match the compiled nanobind modules (issue 20, item 7): the same
public functions, with the same parameter names in the same order. _ffi_cpu is checked
everywhere; _ffi_cuda where it is built (a GPU test; checked here against a local
JAX_KV_CUDA=ON build, which imports without a GPU)."""

import ast
import importlib
import pathlib

import pytest

import jax_kv

PACKAGE = pathlib.Path(jax_kv.__file__).parent


def stub_functions(module: str) -> dict[str, list[str]]:
    """name -> parameter names of each top-level def in jax_kv/<module>.pyi."""
    tree = ast.parse((PACKAGE / f"{module}.pyi").read_text())
    return {
        node.name: [a.arg for a in node.args.args]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }


def module_functions(module: str) -> dict[str, list[str]]:
    """name -> parameter names, read off nanobind's signature of each public function."""
    mod = importlib.import_module(f"jax_kv.{module}")
    out = {}
    for name in dir(mod):
        fn = getattr(mod, name)
        if name.startswith("_") or not callable(fn):
            continue
        signature = fn.__nb_signature__[0][0]  # "def name(a: T[x, y], b: U = 1) -> R"
        out[name] = [p.split(":")[0].split("=")[0].strip() for p in _top_level_params(signature)]
    return out


def _top_level_params(signature: str) -> list[str]:
    """The parameters of "def f(...) -> R", split on the commas outside brackets."""
    body = signature[signature.index("(") + 1 : signature.rindex(") ->")]
    params, depth, start = [], 0, 0
    for i, ch in enumerate(body + ","):
        depth += ch in "[(" and 1 or -(ch in "])" and 1 or 0)
        if ch == "," and depth == 0:
            if body[start:i].strip():
                params.append(body[start:i])
            start = i + 1
    return params


def compare(module: str) -> None:
    stub, real = stub_functions(module), module_functions(module)
    assert sorted(stub) == sorted(real), (
        f"{module}.pyi: missing {sorted(set(real) - set(stub))}, "
        f"stale {sorted(set(stub) - set(real))}"
    )
    for name, params in real.items():
        assert stub[name] == params, f"{module}.{name}: stub {stub[name]}, module {params}"


def test_cpu_stub_matches_the_module():
    compare("_ffi_cpu")


@pytest.mark.gpu
def test_cuda_stub_matches_the_module():
    from jax_kv import _ffi

    if _ffi.cuda_module() is None:
        pytest.fail("jax_kv._ffi_cuda is not built (JAX_KV_CUDA=ON)")
    compare("_ffi_cuda")


def test_the_check_can_fail(tmp_path, monkeypatch):
    """A stub that lost a function or renamed a parameter is caught."""
    text = (PACKAGE / "_ffi_cpu.pyi").read_text()
    broken = tmp_path / "_ffi_cpu.pyi"
    broken.write_text(text.replace("device_id: int", "device: int"))
    monkeypatch.setattr("test_stubs.PACKAGE", tmp_path)
    with pytest.raises(AssertionError, match=r"export_view: stub .*'device'"):
        compare("_ffi_cpu")
