"""What the gate's processes import: a vLLM engine process (``engine_proc``) loads only the gate
modules it runs, and the fault and load drivers reach none of the gate's command line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hybridfa_gate"

# What the engine runs: the worker's RPCs, the L2 wait and snapshot, prompt keys, the load
# role's loop; prompts' token range comes from models.
ENGINE_MODULES = {
    "hybridfa_gate",
    "hybridfa_gate.engine_proc",
    "hybridfa_gate.worker",
    "hybridfa_gate.l2",
    "hybridfa_gate.forge",
    "hybridfa_gate.prompts",
    "hybridfa_gate.models",
    "hybridfa_gate.load_loop",
}


def _gate_imports(module: str) -> set[str]:
    """Every hybridfa_gate module that ``module``'s source imports, at its top or in a
    function, and what those import in turn."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = PACKAGE / (name.removeprefix("hybridfa_gate").lstrip(".") or "__init__")
        tree = ast.parse(path.with_suffix(".py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "hybridfa_gate":
                todo += [f"hybridfa_gate.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridfa_"):
                todo.append(node.module or "")
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("hybridfa_gate.")]
    return seen


def test_an_engine_process_loads_only_the_gate_modules_it_runs() -> None:
    code = (
        "import json, sys, hybridfa_gate.engine_proc; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hybridfa_gate'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert set(json.loads(out)) == ENGINE_MODULES


def test_no_function_of_the_engine_process_imports_another_gate_module() -> None:
    assert _gate_imports("hybridfa_gate.engine_proc") | {"hybridfa_gate"} == ENGINE_MODULES


@pytest.mark.parametrize("driver", ["hybridfa_gate.fault", "hybridfa_gate.load"])
def test_the_fault_and_load_drivers_do_not_import_the_gate_command_line(driver: str) -> None:
    assert "hybridfa_gate.cli" not in _gate_imports(driver)
