"""The library's layout: functions short enough to read in one screen (issue 40)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80


def long_functions(package: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function or method under ``package`` longer than ``limit`` lines
    (decorators excluded, docstring included)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_library_function_is_over_80_lines():
    assert long_functions(ROOT / "eaglenest") == [], "split these into functions that each do one thing"


def test_the_length_check_sees_functions_methods_and_nested_ones(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    (package / "m.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}\n\n\n"
                                  f"class C:\n    def method(self):\n{body.replace('    ', '        ')}\n"
                                  f"        def inner():\n{body.replace('    ', '            ')}\n")
    assert long_functions(package, limit=5) == ["pkg/m.py:5 long (6 lines)", "pkg/m.py:14 method (12 lines)",
                                                "pkg/m.py:20 inner (6 lines)"]
