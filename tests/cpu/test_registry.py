"""The op registry: the public API, the torch registration and the docs' API list all come from
the registered specs, and a new family is one package that the shared layers run as data."""

import os
import re
from typing import NamedTuple

import numpy as np
import pytest
from helpers import ROOT

import cupy_rmsnorm as rn
from cupy_rmsnorm import _pipeline, _validate, ops


def test_every_registered_op_is_public_under_its_name():
    for name, spec in _pipeline.REGISTRY.items():
        assert spec.name == name == spec.public.__name__
        assert getattr(rn, name) is spec.public and name in rn.__all__


def test_the_public_names_are_the_registry_and_its_references():
    references = {ref.__name__ for family in vars(ops).values() for ref in getattr(family, "REFERENCES", ())}
    extra = {"LaunchPlan", "launch_plan", "BackwardPlan", "backward_plan", "__version__"}
    assert set(rn.__all__) == set(_pipeline.REGISTRY) | references | extra
    assert all(callable(getattr(rn, name)) for name in references)


def test_the_readme_api_list_names_every_op():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        glance = f.read().split("## API at a glance")[1].split("\n## ")[0]
    for name in _pipeline.REGISTRY:
        assert re.search(rf"\b{name}\b", glance), f"README's API at a glance leaves out {name}"


def test_each_family_binds_torch_ops_for_all_its_specs():
    torch = pytest.importorskip("torch", reason="torch registration: torch is not installed")
    import cupy_rmsnorm.torch  # noqa: F401 - binds the families' ops
    for name, spec in _pipeline.REGISTRY.items():
        assert spec.traced is not None, name
        assert hasattr(torch.ops.cupy_rmsnorm, name), name


class _ScaleArrays(NamedTuple):
    x: object
    out: object = None


def test_a_new_family_is_a_spec_the_pipeline_runs():
    """A family written outside the package (a toy ``y = x * 2`` with a NumPy reference) runs
    through the shared pipeline: kinds, checks, the NumPy path and out=, with no shared layer
    edited."""
    def check(arrays, factor):
        return _validate._float32_scalar(factor, "factor", "")

    def layout(call, factor):
        if call.metas.x.dtype not in _validate.DTYPES:
            raise TypeError(f"x must be float32, float16 or bfloat16, got {call.metas.x.dtype}")
        return call.resolved, None, call.copied

    def reference(arrays, factor, layout):
        return _pipeline.store(arrays.out, (arrays.x.astype(np.float32) * factor).astype(arrays.x.dtype))

    def launcher(layout, factor, kind):
        raise AssertionError("no GPU here")

    spec = _pipeline.OpSpec("toy_scale", _ScaleArrays, check=check, layout=layout, reference=reference,
                            launcher=launcher, outputs=(1,))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(_pipeline.call(spec, (x, None), (2.0,)), x * 2)
    out = np.empty_like(x)
    assert _pipeline.call(spec, (x, out), (3.0,)) is out and np.array_equal(out, x * 3)
    with pytest.raises(TypeError, match="^x must be float32"):
        _pipeline.call(spec, (x.astype(np.int32), None), (2.0,))
    with pytest.raises(ValueError, match="^factor must be finite"):
        _pipeline.call(spec, (x, None), (float("inf"),))
    with pytest.raises(TypeError, match="^out must be a CuPy array, a NumPy array"):
        _pipeline.call(spec, (x, [1.0]), (2.0,))
    assert "toy_scale" not in _pipeline.REGISTRY         # only register() adds a spec


def test_a_name_registers_once():
    spec = _pipeline.REGISTRY["rms_norm"]
    with pytest.raises(ValueError, match="registered already"):
        _pipeline.register(spec)


def test_every_family_package_is_installed():
    """pyproject.toml's package list holds every package of the library (an installed wheel
    without one fails at import)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml: Python 3.11+")

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    here = os.path.dirname(os.path.abspath(rn.__file__))
    found = {"cupy_rmsnorm." + os.path.relpath(folder, here).replace(os.sep, ".") if folder != here else "cupy_rmsnorm"
             for folder, _, files in os.walk(here) if "__init__.py" in files}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
