"""fla's chunked kernel imported without its package __init__s (kernels/gated_delta_fla.py), on a stand-in package
written here: the CPU machines have no fla, and what is under test is the import, not the kernel (the GPU tests of
tests/kernels/test_gated_delta.py run fla's)."""

import sys

import pytest

from flashtree.kernels.gated_delta_fla import import_without_package_inits


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A package `lib` whose __init__ records that it ran, and a module `lib.ops.kernel` whose package reads the
    version from the root, as fla.utils does."""
    (tmp_path / "lib" / "ops").mkdir(parents=True)
    (tmp_path / "lib" / "__init__.py").write_text("import builtins\nbuiltins.lib_init_ran = True\n__version__ = '9'\n")
    (tmp_path / "lib" / "ops" / "__init__.py").write_text("raise RuntimeError('the ops __init__ imports everything')\n")
    (tmp_path / "lib" / "ops" / "kernel.py").write_text("from lib import __version__\nKERNEL = 'kernel ' + __version__\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("builtins.lib_init_ran", False, raising=False)
    yield
    for name in [m for m in sys.modules if m == "lib" or m.startswith("lib.")]:
        del sys.modules[name]


def test_the_module_imports_without_its_packages_inits(library):
    import builtins

    module = import_without_package_inits("lib.ops.kernel", ("lib", "lib.ops"), {"lib": {"__version__": "1"}})
    assert module.KERNEL == "kernel 1" and not builtins.lib_init_ran


def test_a_module_that_needs_more_of_a_package_is_imported_in_full(library, capsys):
    import builtins

    with pytest.raises(RuntimeError, match="the ops __init__"):  # the plain import runs every __init__
        import_without_package_inits("lib.ops.kernel", ("lib", "lib.ops"), {})
    assert builtins.lib_init_ran
    assert "importing lib.ops.kernel in full (cannot import name '__version__'" in capsys.readouterr().err
