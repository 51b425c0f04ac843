"""Every import points down the layers docs/architecture.md lists (issue 40): a module imports only modules of its
own layer or of a layer below it. The table is read from the document itself, so the two cannot drift apart."""

import ast
import re
from pathlib import Path

import dgemma

PACKAGE = Path(dgemma.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"


def layers() -> list[list[str]]:
    """The layer table's module column, top to bottom: paths relative to dgemma/ ("api/" is a folder)."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and "`" in line.split("|")[2]]
    return [re.findall(r"`([\w/.]+)`", row.split("|")[2]) for row in rows]


def layer_of(module: str, table: list[list[str]]) -> int | None:
    """The index of the layer a dotted module name (dgemma.x.y) belongs to; None: not in the table."""
    path = module.removeprefix("dgemma.").replace(".", "/")
    for i, names in enumerate(table):
        for name in names:
            if name.endswith("/") and (path + "/").startswith(name) or path in (name.removesuffix(".py"),):
                return i
    return None


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dgemma"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dgemma")}
    return found


def test_every_module_is_in_a_layer():
    table = layers()
    assert len(table) >= 8
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if layer_of(".".join(("dgemma", *p.relative_to(PACKAGE).with_suffix("").parts)), table) is None
               and p.name not in ("__init__.py", "__main__.py")]
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


def test_every_import_points_down():
    table, wrong = layers(), []
    for path in PACKAGE.rglob("*.py"):
        me = layer_of(".".join(("dgemma", *path.relative_to(PACKAGE).with_suffix("").parts)), table)
        if me is None:
            continue
        for target in imports(path):
            there = layer_of(target, table)
            if there is not None and there < me:
                wrong.append(f"{path.relative_to(PACKAGE)} -> {target}")
    assert not wrong, "imports that point up the layers of docs/architecture.md:\n" + "\n".join(sorted(wrong))
