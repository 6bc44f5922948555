"""The package's import structure: the import-linter contracts of pyproject.toml (layers, no cycles inside a
package) hold, so an upward import or a cycle fails the suite, not a review."""

from pathlib import Path

from importlinter.cli import lint_imports

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_hold():
    # no_cache: nothing written into the checkout; a broken contract prints its report to the captured stdout
    assert lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True) == 0
