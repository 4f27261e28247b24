"""The Tracekit Box kernel's helpers see the kernel only through KernelPort (jupyter/kernel/port.py), and
TkboxKernel provides all of it.

Checked on the source, as test_door_context.py checks the doors: a helper that read a private member of the kernel,
or assigned one of its fields, would work until the kernel's inside changed. In a helper the kernel is named `port`
(a parameter, `self.port`); every attribute read off it must be a member of KernelPort, none is assigned, and it is
handed on only as the `port` of another helper (no alias under another name). On the kernel's side, whatever it
passes itself to is a helper taking it as `port`, and no private method of its own goes to a helper as a callback.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tests.source_scan import is_named, set_in
from tkbox_nb.jupyter.kernel.app import TkboxKernel
from tkbox_nb.jupyter.kernel.port import KernelPort

KERNEL = Path(__file__).resolve().parent.parent / "tkbox_nb" / "jupyter" / "kernel"
HELPERS = sorted(p.name for p in KERNEL.glob("*.py") if p.name not in ("__init__.py", "app.py", "port.py"))
TAKE_THE_PORT = ["box_wait.py", "cells.py", "comms.py", "stdin.py"]
MEMBERS = {name for name, value in vars(KernelPort).items()
           if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}


def is_port(node: ast.AST) -> bool:
    return is_named(node, "port")


def takes_port(tree: ast.Module) -> dict[str, list[str]]:
    """Each function and class of a module by the names of its parameters (a class: its __init__'s, less self)."""
    params = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            params[node.name] = [a.arg for a in node.args.args]
        elif isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    params[node.name] = [a.arg for a in f.args.args][1:]
    return params


def helper_params() -> dict[str, list[str]]:
    params = {}
    for name in HELPERS:
        params.update(takes_port(ast.parse((KERNEL / name).read_text())))
    return params


def scan(source: str, params: dict[str, list[str]]) -> tuple[set[str], list[str]]:
    """(the members read off the port, what else the module does with it: assigns a member, aliases it, passes it
    to what is not a helper's `port`)."""
    tree = ast.parse(source)
    used, wrong = set(), []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not is_port(node) or isinstance(node, ast.Attribute) and is_port(node.value):
            continue  # `port.port`: the read of member `port`, seen below
        up = parents.get(node)
        if isinstance(up, ast.Attribute) and up.value is node:
            used.add(up.attr)
            if not isinstance(up.ctx, ast.Load):
                wrong.append(f"assigns {up.attr}")
        elif isinstance(up, ast.Assign) and len(up.targets) == 1 and is_port(up.targets[0]) and is_port(up.value):
            continue  # `self.port = port`, `port = self.port`
        elif isinstance(up, ast.Call) and node in up.args and isinstance(up.func, ast.Name) and \
                params.get(up.func.id, [])[up.args.index(node):][:1] == ["port"]:
            continue  # handed on as another helper's port
        elif isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Store):
            wrong.append(f"port at line {node.lineno} in a {type(up).__name__}")
    return used, wrong


def test_the_interface_is_what_the_helpers_were_given():
    assert MEMBERS == {"nb", "running", "box_kernel", "send", "publish_status", "host_reply", "log", "ready",
                       "receive", "serve_control", "check_deadlines", "into_box", "attach", "open_request",
                       "request_open", "protocol_violation"}


@pytest.mark.parametrize("helper", HELPERS)
def test_a_helper_uses_only_the_kernel_port(helper):
    used, wrong = scan((KERNEL / helper).read_text(), helper_params())
    assert used or helper not in TAKE_THE_PORT, f"{helper} reads nothing off the port: the walk missed its name"
    assert used - MEMBERS == set(), f"{helper} reaches past KernelPort"
    assert wrong == []


@pytest.mark.parametrize("snippet, why", [
    ("class C:\n    def f(self, channel, idents, msg):\n        self.port._dispatch(channel, idents, msg)\n",
     "reads _dispatch"),
    ("def f(port, sent, target):\n    port.requests[sent] = target\n", "reads requests"),
    ("class C:\n    def f(self):\n        self.port.running = False\n", "assigns running"),
    ("class C:\n    def f(self):\n        k = self.port\n        k.sockets['control'].poll(10)\n", "aliases the port"),
    ("def f(port):\n    other(port)\n", "hands the port to what is not a helper's port"),
])
def test_the_scan_sees_a_helper_reach_past_the_port(snippet, why):
    used, wrong = scan(snippet, {"wait_for_box": ["port", "channel"]})
    assert used - MEMBERS or wrong, why


def test_the_scan_lets_a_helper_hand_the_port_on():
    snippet = "class C:\n    def __init__(self, port):\n        self.port = port\n" \
              "    def f(self, channel):\n        port = self.port\n        wait_for_box(port, channel)\n" \
              "        port.send(channel, 't', {}, None)\n"
    assert scan(snippet, {"wait_for_box": ["port", "channel"]}) == ({"send"}, [])


def test_the_kernel_gives_itself_only_to_helpers_as_their_port():
    tree = ast.parse((KERNEL / "app.py").read_text())
    params, given, private = helper_params(), [], []
    own = {name for name, value in vars(TkboxKernel).items() if inspect.isfunction(value)}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        callee = call.func
        while isinstance(callee, ast.Attribute):
            callee = callee.value
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Name) and arg.id == "self":
                given.append((call.func.id, params[call.func.id][i]) if isinstance(call.func, ast.Name) else ("?", ""))
            elif isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "self" and \
                    arg.attr in own and arg.attr not in MEMBERS and \
                    (isinstance(call.func, ast.Name) and call.func.id in params or
                     isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Attribute) and
                     call.func.value.attr in ("cells", "comms", "stdin")):
                private.append(arg.attr)
    assert sorted(given) == [("Cells", "port"), ("CommGate", "port"), ("Stdin", "port")]
    assert private == []


def test_the_kernel_provides_every_member():
    """Methods on the class, with the protocol's parameters; attributes as TkboxKernel.__init__ sets them."""
    assigned = set_in(TkboxKernel.__init__)
    for name in sorted(MEMBERS):
        protocol = vars(KernelPort)[name]
        if isinstance(protocol, property):
            assert name in assigned, name
        else:
            assert list(inspect.signature(getattr(TkboxKernel, name)).parameters) == \
                list(inspect.signature(protocol).parameters), name


def test_every_method_the_kernel_calls_on_itself_is_its_own():
    """A rename that missed a caller (kernel_info once became box_kernel_info) fails here, not in a frontend's wait."""
    own = {name for name, value in vars(TkboxKernel).items() if inspect.isfunction(value)}
    called = {n.func.attr for n in ast.walk(ast.parse((KERNEL / "app.py").read_text()))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and
              isinstance(n.func.value, ast.Name) and n.func.value.id == "self"}
    assert called and called - own == set()
