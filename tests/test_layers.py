"""The layers of tkbox_nb and which may import which (docs/layers.md), checked on the source.

Every import in the package counts: at the top of a module, inside a function (the usual way a circle hides), and
under `if TYPE_CHECKING:` (a type is still something the module must be read with). A module may import its own
layer or a lower one, and no modules may import each other in a circle, even within a layer. Importing a submodule
also runs its package's `__init__`; that is Python's doing and is not counted as an edge.

No import breaks this today: KNOWN_VIOLATIONS, where one would be listed with why and who removes it, is empty
(issue 24 emptied it). An entry whose import is gone, or no longer breaks the order or closes a circle, fails the
test, so an entry is taken out when it is fixed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "tkbox_nb"

# Bottom first. A module belongs to the layer of the longest name below that is it or a package holding it.
LAYERS: list[tuple[str, list[str]]] = [
    ("guest", ["tkbox_nb.guest"]),
    ("core", ["tkbox_nb._version", "tkbox_nb.core"]),
    ("stream", ["tkbox_nb.stream"]),
    ("rules", ["tkbox_nb.rules"]),
    ("policy", ["tkbox_nb.policy"]),
    ("bundle", ["tkbox_nb.bundle"]),
    ("signing", ["tkbox_nb.signing"]),
    ("backends", ["tkbox_nb.backends"]),
    ("doors", ["tkbox_nb.doors"]),
    ("box", ["tkbox_nb.box"]),
    ("audit", ["tkbox_nb.audit"]),
    ("jupyter", ["tkbox_nb.jupyter"]),
    ("cli and the package", ["tkbox_nb.cli", "tkbox_nb.kernel", "tkbox_nb"]),
]

# (importer, imported): why it is here and who takes it out. Each must still exist and still break the rule. Empty:
# keep it so, by moving code to the layer it belongs in rather than listing an import here.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name, for its __init__)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def import_edges(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) for every import statement anywhere in each module that names one of `modules`.
    `from X import Y` counts as an import of X.Y when that is a module, else of X (Y is a name in it)."""
    top = next(iter(modules)).split(".")[0]
    edges = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                while target not in modules and "." in target:  # `import a.b.c` of a name inside a.b
                    target = target.rpartition(".")[0]
                if target in modules and target != name and target.split(".")[0] == top:
                    edges.add((name, target))
    return edges


def layer_of(module: str) -> int | None:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan): each is at least one import circle."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


MODULES = module_names()
EDGES = import_edges(MODULES)


def against_order(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, b in edges if layer_of(a) < layer_of(b)}


def test_every_module_has_a_layer():
    """A new module is placed in the map (here and in docs/layers.md) before it can import anything."""
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_no_import_goes_up_the_layers():
    up = sorted(against_order(EDGES) - set(KNOWN_VIOLATIONS))
    assert up == [], "\n".join(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})" for a, b in up)


def test_no_import_circles():
    left = circles(EDGES - set(KNOWN_VIOLATIONS))
    assert left == [], "import circles: " + "; ".join(" <-> ".join(c) for c in left)


def test_each_known_violation_still_exists_and_still_breaks_the_rule():
    """So the list only shrinks: a fixed import left here fails, and so does one that no longer breaks anything."""
    in_a_circle = {m for c in circles(EDGES) for m in c}
    stale = [edge for edge in KNOWN_VIOLATIONS
             if edge not in EDGES or not (edge in against_order(EDGES) or set(edge) <= in_a_circle)]
    assert stale == [], f"fixed (take them out of KNOWN_VIOLATIONS): {stale}"


# Inside backends (docs/layers.md): each tier may import only lower tiers, and no module imports another of its own
# tier, so no concrete backend knows another; `registry` alone knows them all. The package's `__init__` is above all.
BACKEND_TIERS: list[list[str]] = [["base", "seccomp", "memory_limit", "gpu_facts", "mounts"], ["initramfs", "gpus"],
                                  ["image", "linux_kernel"], ["microvm"],
                                  ["warm_start"], ["bwrap", "qemu", "firecracker"], ["registry"]]


def backend_order_breaks(edges: set[tuple[str, str]], modules: dict | None = None) -> list[str]:
    """Every import between two modules of `tkbox_nb.backends` that is not from a higher tier to a lower one, and
    every module there that has no tier."""
    prefix = "tkbox_nb.backends."
    tier = {prefix + name: i for i, names in enumerate(BACKEND_TIERS) for name in names}
    out = [f"{m} has no tier in BACKEND_TIERS" for m in (modules or MODULES) if m.startswith(prefix) and m not in tier]
    for a, b in sorted(edges):
        if a in tier and b in tier and tier[a] <= tier[b]:
            out.append(f"{a} imports {b}" + (" (a backend imports another)" if tier[a] == tier[b] else ""))
    return out


def test_no_backend_imports_another_and_the_backends_import_only_down():
    assert backend_order_breaks(EDGES) == []


def test_the_backend_order_check_sees_one_backend_importing_another():
    """Found by a review: the layer check alone let `firecracker` import `qemu`, one layer for all of backends."""
    b = "tkbox_nb.backends."
    assert backend_order_breaks(EDGES | {(b + "firecracker", b + "qemu")}) == [
        f"{b}firecracker imports {b}qemu (a backend imports another)"]
    assert backend_order_breaks(EDGES | {(b + "microvm", b + "warm_start")}) == [
        f"{b}microvm imports {b}warm_start"]
    assert backend_order_breaks(EDGES, {**MODULES, b + "newvm": None}) == [f"{b}newvm has no tier in BACKEND_TIERS"]


MAX_LINES = 450


def test_no_module_is_over_450_lines():
    """A module that grows past this holds more than one concept: split it by concept (as backends/image.py and
    backends/initramfs.py were), not by line count. Tests and fuzz targets are not held to it."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_layer_map_in_the_docs_names_these_layers_in_this_order():
    text = (REPO / "docs" / "layers.md").read_text()
    rows = re.findall(r"^\| *(\d+) *\| *([^|]+?) *\|", text, re.M)
    assert [(int(n), name) for n, name in rows] == [(i, name) for i, (name, _) in enumerate(LAYERS)]


def test_the_walk_sees_function_level_and_type_checking_imports_and_finds_their_circle(tmp_path):
    """The checker itself, on a package made here: the imports a module-level scan would miss are the edges that
    close the circle, so a walk that missed them would find none."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .low import VALUE\n")
    (pkg / "sub" / "low.py").write_text("from typing import TYPE_CHECKING\nVALUE = 1\n"
                                        "if TYPE_CHECKING:\n    from ..high import High\n")
    (pkg / "high.py").write_text("import os\nfrom .sub import low\n\n\nclass High:\n"
                                 "    def f(self):\n        from . import mid\n        return mid\n")
    (pkg / "mid.py").write_text("def g():\n    from pkg.sub.low import VALUE\n    return VALUE\n")
    modules = module_names(pkg)
    assert set(modules) == {"pkg", "pkg.sub", "pkg.sub.low", "pkg.high", "pkg.mid"}
    edges = import_edges(modules)
    assert edges == {("pkg.sub", "pkg.sub.low"), ("pkg.sub.low", "pkg.high"), ("pkg.high", "pkg.sub.low"),
                     ("pkg.high", "pkg.mid"), ("pkg.mid", "pkg.sub.low")}
    assert circles(edges) == [["pkg.high", "pkg.mid", "pkg.sub.low"]]
    assert circles(edges - {("pkg.sub.low", "pkg.high")}) == []


@pytest.mark.parametrize("module,layer", [("tkbox_nb.doors.egress", "doors"), ("tkbox_nb.rules.hostnames",
                                          "rules"), ("tkbox_nb.backends.qemu", "backends"),
                                          ("tkbox_nb", "cli and the package"), ("tkbox_nb.guest.vm", "guest"),
                                          ("tkbox_nb.kernel", "cli and the package"),
                                          ("tkbox_nb.jupyter.kernel.app", "jupyter")])
def test_a_module_takes_the_layer_of_its_longest_prefix(module, layer):
    assert LAYERS[layer_of(module)][0] == layer


# What may sit directly under tkbox_nb/ besides the layers' folders: the package, its version, and the kernel's
# public entry point (`python -m tkbox_nb.kernel`, named in every installed kernel.json).
TOP_LEVEL = {"tkbox_nb", "tkbox_nb._version", "tkbox_nb.kernel", "tkbox_nb.kernel.__main__"}


def test_each_folder_is_one_layer_and_little_sits_outside_them():
    """The folders show the layers: a layer is one folder (core also holds `_version`; the top also holds the
    package and the kernel's entry point), every folder under tkbox_nb/ is exactly one layer's prefix, and at most
    five modules sit directly under tkbox_nb/."""
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    prefixes = {prefix for _, names in LAYERS for prefix in names}
    assert sorted(f for f in folders if f"tkbox_nb.{f}" not in prefixes) == []
    for name, names in LAYERS:
        assert len([p for p in names if p not in TOP_LEVEL]) <= 1, f"layer {name} spans several folders: {names}"
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= 5, flat
    assert [m for m in MODULES if m.count(".") == 1 and m not in TOP_LEVEL
            and not (PACKAGE / m.split(".")[1] / "__init__.py").is_file()] == []
