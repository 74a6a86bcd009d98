"""The import floors of DESIGN.md, held by walking every module's imports.

ground  (cag/kv.py, cag/models/)  imports nothing of the project above it;
middle  (stores/, mappers/)       imports only the ground, never each other;
top     (the rest of cag/, eval/) may import anything.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in {"cag", "stores", "mappers", "eval"}}


def is_ground(module: str) -> bool:
    return module == "cag.kv" or module == "cag.models" or module.startswith("cag.models.")


def modules(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def test_ground_imports_only_ground():
    files = [ROOT / "cag" / "kv.py", *modules("cag/models")]
    bad = {str(f.relative_to(ROOT)): sorted(m for m in project_imports(f) if not is_ground(m)) for f in files}
    assert not {k: v for k, v in bad.items() if v}


def test_middle_imports_only_ground():
    for folder, other in (("stores", "mappers"), ("mappers", "stores")):
        for f in modules(folder):
            imports = project_imports(f)
            foreign = sorted(m for m in imports
                             if not is_ground(m) and not m.startswith(folder) and m != "cag")
            assert not foreign, f"{f.relative_to(ROOT)} imports {foreign}"
            assert not any(m.startswith(other) for m in imports)
            # `import cag` would pull in the lazy top level; the middle names ground modules directly
            assert "cag" not in imports, f"{f.relative_to(ROOT)} imports the top-level package"
