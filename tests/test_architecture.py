"""The package's import structure: the import-linter contracts of pyproject.toml (layers, no cycles inside a
package) hold, and no module imports itself through others, so an upward import or a cycle fails the suite,
not a review."""

import subprocess
import sys
from pathlib import Path

import grimp

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_hold():
    # In a process of its own: import-linter configures logging, which would silence the server's loggers
    # for the tests after this one. No cache: nothing is written into the checkout.
    check = (f"import sys; from importlinter.cli import lint_imports; "
             f"sys.exit(lint_imports(config_filename={str(PYPROJECT)!r}, no_cache=True, no_logo=True))")
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_module_imports_itself_through_others():
    """No import cycle anywhere in the package, across packages too (the contracts check cycles inside each
    package); imports inside functions count."""
    graph = grimp.build_graph("flashtree")
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(" -> ".join((module, *back)))
    assert cycles == []
