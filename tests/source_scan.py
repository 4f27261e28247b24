"""What the interface tests read off the source with ast: test_door_context.py (a door sees its box only as a
DoorContext) and test_kernel_port.py (a kernel helper sees the kernel only as a KernelPort) ask the same two
questions of different names, so the walk that answers them is written once, here."""

from __future__ import annotations

import ast
import inspect
from typing import Callable


def is_named(node: ast.AST, name: str) -> bool:
    """The node is the object a class keeps as `name`: the name itself (`box`) or its field (`self.box`)."""
    return isinstance(node, ast.Name) and node.id == name or \
        isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name) and \
        node.value.id == "self"


def attributes_of(source: str, name: str, filename: str = "<source>") -> set[str]:
    """Each attribute taken off `name` or `self.name` in the source (read or written)."""
    return {node.attr for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.Attribute) and is_named(node.value, name)}


def set_in(method: Callable) -> set[str]:
    """The fields a method (an __init__) sets on self: `self.X = ...` and `self.X: T = ...`, in its source."""
    tree = ast.parse(inspect.getsource(method).replace("\n    ", "\n").strip())
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and
            t.value.id == "self"}
