"""`%box_pull`'s refusal of the host kernel's own names (magics_cell.pull_refusal), against a real IPython shell's
namespace."""

from __future__ import annotations

import pytest

from tkbox_nb.jupyter.magics_cell import pull_refusal


@pytest.fixture(scope="module")
def hidden():
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    yield dict(ip.user_ns_hidden)
    InteractiveShell.clear_instance()


@pytest.mark.parametrize("name", ["__builtins__", "__name__", "_", "__", "___", "_i", "_i1", "_ii", "_oh", "_ih",
                                  "_dh", "_private", "get_ipython", "In", "Out", "exit", "quit", "None", "class"])
def test_box_pull_refuses_names_the_host_kernel_relies_on(name, hidden):
    assert pull_refusal(name, hidden), name


def test_ipython_s_own_names_are_refused_under_any_shell():
    """A shell whose user_ns_hidden is empty (or not IPython's) still keeps its get_ipython, In, Out, exit, quit."""
    assert all(pull_refusal(n, {}) for n in ("get_ipython", "In", "Out", "exit", "quit"))


@pytest.mark.parametrize("name", ["data", "result", "x_", "value2", "print", "id", "sum"])
def test_box_pull_takes_the_notebook_s_own_variables(name, hidden):
    assert pull_refusal(name, hidden) is None
