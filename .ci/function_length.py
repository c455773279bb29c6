"""Fails when a function in jmem/ is longer than the limit (80 lines, its docstring not counted).

Usage: python .ci/function_length.py [LIMIT]
"""

import ast
import pathlib
import sys


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].end_lineno - body[0].lineno + 1
    return 0


def main() -> int:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    root = pathlib.Path(__file__).resolve().parent.parent / "jmem"
    too_long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if n > limit:
                    too_long.append(
                        f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {n}"
                    )
    for line in too_long:
        print(f"function longer than {limit} lines (docstring not counted): {line}")
    return 1 if too_long else 0


if __name__ == "__main__":
    sys.exit(main())
