"""The bridge's count setter (guest/kernel.SET_COUNT) in a real IPython shell, in process: it is a string of code the
bridge runs silently in the box's ipykernel before each numbered cell, so an IPython InteractiveShell runs it here
the way the box's kernel does (run_cell, silent, not stored). The e2e test in tests/e2e/test_kernel.py runs it in a
real box; these check what a box cannot cheaply show: a hostile count, and a namespace whose builtins are rebound."""

import pytest
from IPython.core.interactiveshell import InteractiveShell

from tkbox_nb.guest.kernel import COUNT_MAX_JUMP, SET_COUNT


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    shell.reset()
    shell.execution_count = 1  # reset() keeps the count; a fresh box's kernel starts at 1
    yield shell
    InteractiveShell.clear_instance()


def cell(ip, code, n=None):
    """One cell as the bridge gives it: the setter first (silent, not stored) when the host numbered it."""
    if n is not None:
        done = ip.run_cell(SET_COUNT % n, store_history=False, silent=True)
        assert done.error_in_exec is None and done.error_before_exec is None, done
    result = ip.run_cell(code, store_history=True)
    assert result.error_in_exec is None, result
    return result


def state(ip):
    return ip.execution_count, len(ip.user_ns["In"]), len(ip.history_manager.input_hist_raw)


def test_the_count_moves_up_and_in_is_padded_to_the_frontend_s_number(ip):
    cell(ip, "10 + 1", 1)
    cell(ip, "20 + 2", 3)  # a host-magic cell took [2]
    assert ip.user_ns["Out"] == {1: 11, 3: 22} and ip.user_ns["In"][2] == "" and ip.user_ns["In"][3] == "20 + 2"
    assert state(ip) == (4, 4, 4)
    cell(ip, "1", 2)  # never moved back
    assert state(ip) == (5, 5, 5)


@pytest.mark.parametrize("rebind", ["from numpy import *", "max = None; len = None; setattr = None; min = None",
                                    "get_ipython = None"])
def test_names_a_cell_rebinds_do_not_stop_the_count(ip, rebind):
    """The setter looked up max, len, setattr and get_ipython in the user's namespace: after `from numpy import *`
    (numpy 2's max takes no (int, int) as a builtin does) it raised, its error stayed in the box, the history was padded
    but the count not moved, and every later In/Out/_n named another cell than the frontend shows."""
    cell(ip, rebind, 1)
    cell(ip, "7 * 6", 3)
    assert ip.user_ns["Out"].get(3) == 42 and ip.user_ns["_3"] == 42 and ip.user_ns["In"][3] == "7 * 6"
    assert state(ip) == (4, 4, 4)


def test_a_hostile_count_pads_at_most_the_bound_and_beyond_it_changes_nothing(ip):
    """A rerun's count comes from the original bundle (the original box's signed result): 2**31 - 1 made the setter
    pad about two billion history entries in the rerun's box."""
    cell(ip, "1", 1)
    cell(ip, "2", 2 ** 31 - 1)  # beyond the bound: the box keeps its own number, nothing padded
    assert state(ip) == (3, 3, 3) and ip.user_ns["Out"] == {1: 1, 2: 2}
    cell(ip, "3", 3 + COUNT_MAX_JUMP)  # at the bound: moved and padded, the names agree
    n = 3 + COUNT_MAX_JUMP
    assert state(ip) == (n + 1, n + 1, n + 1) and ip.user_ns["Out"][n] == 3 and ip.user_ns["In"][n] == "3"
    cell(ip, "4", n + 2 + COUNT_MAX_JUMP)
    assert state(ip) == (n + 2, n + 2, n + 2)


def test_a_cleared_history_is_padded_no_more_than_the_bound(ip):
    """The padding is bounded by itself too, not only through the count's jump: a cell may empty In."""
    cell(ip, "1", 1)
    cell(ip, "In.clear(); get_ipython().history_manager.input_hist_raw.clear()", 2)
    cell(ip, "0", 3 + COUNT_MAX_JUMP)
    assert ip.execution_count == 4 + COUNT_MAX_JUMP and len(ip.user_ns["In"]) == COUNT_MAX_JUMP + 1
