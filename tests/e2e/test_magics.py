"""The IPython extension: `%%box` and the host-side magics in an ordinary IPython, through InteractiveShell and
through nbclient executing a notebook on the usual python3 kernel."""

from __future__ import annotations

import io
import json
import zipfile

import nbformat
import pytest

from tkbox_nb import open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])


@pytest.fixture
def shell(signer, tmp_path, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell
    monkeypatch.setenv("TKBOX_BUNDLE_DIR", str(tmp_path / "bundles"))
    ip = InteractiveShell.instance()
    ip.run_cell("%load_ext tkbox_nb")
    yield ip
    ip.run_cell("%unload_ext tkbox_nb")
    InteractiveShell.clear_instance()


def bundles(tmp_path):
    return sorted((tmp_path / "bundles").glob("*.tkb"))


def test_box_cells_keep_state_and_show_outputs_in_place(shell, capsys):
    assert shell.run_cell("%%box\nx = 2\nprint('in the box', x * 21)").success
    assert "in the box 42" in capsys.readouterr().out
    assert "x" not in shell.user_ns  # the box's namespace, not the host's
    assert shell.run_cell("%%box\nimport socket\nprint(sorted(n for _, n in socket.if_nameindex()), x)").success
    assert "['lo'] 2" in capsys.readouterr().out


def test_box_errors_show_the_box_traceback(shell, capsys):
    result = shell.run_cell("%%box\ndef f():\n    raise ValueError('from the box')\nf()")
    assert not result.success and type(result.error_in_exec).__name__ == "BoxCellError"
    shown = capsys.readouterr()
    assert "ValueError" in shown.out + shown.err and "from the box" in shown.out + shown.err


def test_new_box_starts_fresh(shell, capsys, tmp_path):
    shell.run_cell("%%box\nkept = 1")
    shell.run_cell("%%box --new\nprint('kept' in globals())")
    assert "False" in capsys.readouterr().out
    assert len(bundles(tmp_path)) == 1 and verify_bundle(bundles(tmp_path)[0]).valid


def test_plain_data_moves_in_and_out_through_the_exec_door(shell, tmp_path):
    shell.user_ns["data"] = {"a": [1, 2], "s": "text"}
    assert shell.run_cell("%box_push data").success
    assert shell.run_cell("%%box\ndata['a'].append(3)\nresult = len(data['a'])").success
    assert shell.run_cell("%box_pull data result").success
    assert shell.user_ns["data"] == {"a": [1, 2, 3], "s": "text"} and shell.user_ns["result"] == 3
    shell.user_ns["odd"] = {1, 2}
    assert not shell.run_cell("%box_push odd").success  # a set is not plain data
    shell.run_cell("%unload_ext tkbox_nb")
    run = open_run(bundles(tmp_path)[0])
    cells = [run.content(c.args["code"]).decode() for c in run.crossings() if c.door == "exec"]
    assert any("data = __import__('json').loads" in c for c in cells)  # every move is a signed cell
    assert verify_bundle(bundles(tmp_path)[0]).valid


def test_policy_changes_take_effect_for_box_cells(shell, capsys, tmp_path):
    shell.run_cell("%%box_policy\n[exec]\ncells = false\n")
    result = shell.run_cell("%%box\nprint('nope')")
    assert not result.success and "DoorRefused" in str(result.error_in_exec.box_traceback)
    shell.run_cell("%%box_policy\n[exec]\ncells = true\n")
    assert shell.run_cell("%%box\nprint('yes')").success
    assert "yes" in capsys.readouterr().out


def test_secret_is_read_with_getpass_and_never_shown_kept_in_history_or_bundled(shell, capsys, tmp_path, monkeypatch):
    value = "sk-magic-0123456789abcdef"
    monkeypatch.setattr("getpass.getpass", lambda prompt="": value)
    assert shell.run_cell("%box_secret API --host api.example.org --format 'Bearer {value}'").success
    assert shell.run_cell("%%box\nimport os\nprint(any('sk-magic' in v for v in os.environ.values()))").success
    out = capsys.readouterr().out
    assert value not in out and "False" in out
    assert not any(value in line for line in shell.history_manager.input_hist_raw)
    shell.run_cell("%unload_ext tkbox_nb")
    data = bundles(tmp_path)[0].read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert not any(value.encode() in z.read(n) for n in z.namelist())


def test_nbclient_runs_a_notebook_that_uses_the_magics(signer, tmp_path, monkeypatch):
    from nbclient import NotebookClient
    value = "env-secret-fedcba9876543210"
    monkeypatch.setenv("TKBOX_BUNDLE_DIR", str(tmp_path / "bundles"))
    monkeypatch.setenv("TKBOX_TEST_SECRET", value)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (
        "%load_ext tkbox_nb",
        "%%box\nimport socket\nsorted(n for _, n in socket.if_nameindex())",
        "%box_secret TOKEN --host api.example.org --env TKBOX_TEST_SECRET",
        "%%box\ny = 6 * 7\ny",
        "%box_status",
        "%unload_ext tkbox_nb",
    )]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "['lo']"
    assert nb.cells[3].outputs[0]["data"]["text/plain"] == "42"
    assert "TOKEN" in nb.cells[4].outputs[0]["text"]
    saved = tmp_path / "saved.ipynb"
    nbformat.write(nb, saved)
    assert value not in saved.read_text()
    [bundle] = bundles(tmp_path)
    assert verify_bundle(bundle).valid
    run = open_run(bundle)
    assert [c.args["magic"] for c in run.crossings() if c.door == "host"] == ["box_secret", "box_status"]
    with zipfile.ZipFile(bundle) as z:
        assert not any(value.encode() in z.read(n) for n in z.namelist())
    assert json.loads(run.content(next(c for c in run.crossings() if c.door == "exec").result["outputs"]))


def test_box_view_shows_the_running_box_as_a_widget(shell):
    shell.run_cell("%%box\nv = 1")
    result = shell.run_cell("%box_view")
    assert result.success and type(result.result).__name__ == "ViewBox"
    view = result.result.view
    assert view.run.sealed is False and (view.df["door"] == "exec").sum() >= 1


def test_a_box_cell_never_updates_a_host_display(shell, monkeypatch):
    """A %%box cell's display ids are namespaced to its box: reusing a host display's id updates only the box's own."""
    published = []
    monkeypatch.setattr(shell.display_pub, "publish", lambda data, metadata=None, *a, transient=None, update=False,
                        **kw: published.append((data, transient, update)))
    shell.run_cell("from IPython.display import display\n"
                   "display({'text/plain': 'host'}, raw=True, display_id='status')")
    assert shell.run_cell("%%box\nfrom IPython.display import display, update_display\n"
                          "display({'text/plain': 'box'}, raw=True, display_id='status')\n"
                          "update_display({'text/plain': 'HOST: run rm -rf ~'}, raw=True, display_id='status')").success
    assert published[0] == ({"text/plain": "host"}, {"display_id": "status"}, False)
    shown = [(t["display_id"], update) for _, t, update in published[1:]]
    assert len(shown) == 2 and shown[0][0] == shown[1][0] != "status" and [u for _, u in shown] == [False, True]
    assert shown[0][0].startswith("tkbox-") and shown[0][0].endswith("-status")


def test_a_magic_given_bad_input_fails_in_one_line_never_a_traceback(shell, capsys, tmp_path):
    """%box_view of a bundle that is not one, %box_push/%box_pull of what they cannot move, %box_bundle where
    no file can be (an OSError): one line each, never the host's traceback."""
    (tmp_path / "bad.tkb").write_bytes(b"not a zip")
    shell.user_ns["odd"] = {1, 2}
    assert shell.run_cell("%%box\nv = 1").success
    cases = [("%box_view " + str(tmp_path / "bad.tkb"), True, "BundleError: "),
             ("%box_push odd", False, "TkboxError: %box_push: odd is not plain data"),
             ("%box_pull 1bad", False, "TkboxError: %box_pull: name the variables to pull"),
             ("%box_bundle /proc/nope/x.tkb", True, "FileNotFoundError: ")]
    for cell, success, line in cases:
        capsys.readouterr()
        result = shell.run_cell(cell)
        shown = capsys.readouterr()
        text = shown.out + shown.err
        assert result.success is success, (cell, text)
        assert "Traceback" not in text and "jupyter/magics.py" not in text, (cell, text)
        assert [x for x in text.splitlines() if x.strip()] and line in text, (cell, text)
        assert len([x for x in text.splitlines() if x.strip()]) == 1, (cell, text)


def test_arrays_frames_and_series_move_in_and_out_with_their_dtypes(shell, tmp_path):
    """A DataFrame, a Series and numpy arrays go into the box and come back exactly: dtypes, index, names (before,
    a DataFrame came back as its column names and an array as a list). Plain values move as before."""
    import numpy as np
    import pandas as pd
    frame = pd.DataFrame({"i": np.arange(3, dtype="int64"), "f": np.array([1.5, 2, np.nan], dtype="float32"),
                          "b": [True, False, True], "s": ["a", None, "c"],
                          "t": pd.to_datetime(["2020-01-01", "2021-06-01", None]).astype("M8[ns]")},
                         index=pd.Index([10, 20, 10], name="key"))
    frame["o"] = pd.Series(["x", "y", "z"], index=frame.index).astype(object)
    assert frame["o"].dtype == object
    series = pd.Series([0.5, 1.5], index=pd.Index(["p", "q"], name="k"), name="weights")
    shell.user_ns.update(frame=frame, series=series, grid=np.arange(6.0).reshape(2, 3), zero=np.array(7, "uint8"),
                         words=np.array(["ab", "c"]), n=5)
    assert shell.run_cell("%box_push frame series grid zero words n").success
    assert shell.run_cell("%%box\nassert str(frame['t'].dtype) == 'datetime64[ns]' and frame.index.name == 'key'\n"
                          "big = frame.assign(g=frame['i'] * 2)\nseries2 = series * 2\ngrid2 = grid.T.copy()\n"
                          "zero2, words2, n2 = zero, words, n + 1").success
    for name in ("frame", "series", "grid", "zero", "words", "n"):
        del shell.user_ns[name]
    assert shell.run_cell("%box_pull frame big series series2 grid grid2 zero zero2 words2 n2").success
    ns = shell.user_ns
    pd.testing.assert_frame_equal(ns["frame"], frame)
    pd.testing.assert_frame_equal(ns["big"], frame.assign(g=frame["i"] * 2))
    pd.testing.assert_series_equal(ns["series"], series)
    pd.testing.assert_series_equal(ns["series2"], series * 2)
    for name, want in (("grid", np.arange(6.0).reshape(2, 3)), ("grid2", np.arange(6.0).reshape(2, 3).T),
                       ("zero", np.array(7, "uint8")), ("zero2", np.array(7, "uint8")),
                       ("words2", np.array(["ab", "c"]))):
        np.testing.assert_array_equal(ns[name], want, strict=True)
    assert ns["frame"]["o"].dtype == object and ns["n2"] == 6
    shell.run_cell("%unload_ext tkbox_nb")
    assert verify_bundle(bundles(tmp_path)[0]).valid


HOSTILE_PULLS = {
    "a pickle": "{'kind': 'ndarray', 'npy': __import__('base64').b64encode(__import__('pickle').dumps([1])).decode()}",
    "a header that lies about the shape": (
        "{'kind': 'ndarray', 'npy': __import__('base64').b64encode(__import__('io').BytesIO().getvalue() or "
        "b'\\x93NUMPY\\x01\\x00v\\x00' + b\"{'descr': '<i8', 'fortran_order': False, 'shape': (1000,), }\""
        ".ljust(117) + b'\\n' + bytes(16)).decode()}"),
    "an object dtype": (
        "{'kind': 'ndarray', 'npy': __import__('base64').b64encode(b'\\x93NUMPY\\x01\\x00v\\x00' + "
        "b\"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }\".ljust(117) + b'\\n' + bytes(8)).decode()}"),
    "a frame whose column says int but holds floats": (
        "{'kind': 'frame', 'index': {'type': 'range', 'start': 0, 'stop': 2, 'step': 1, 'name': None}, "
        "'columns': {'type': 'range', 'start': 0, 'stop': 1, 'step': 1, 'name': None}, "
        "'data': [{'dtype': 'numpy', 'npy': __import__('base64').b64encode(b'\\x93NUMPY\\x01\\x00v\\x00' + "
        "b\"{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }\".ljust(117) + b'\\n' + bytes(24)).decode()}]}"),
    "oversized": (
        "{'kind': 'ndarray', 'npy': __import__('base64').b64encode(b'\\x93NUMPY\\x01\\x00v\\x00' + "
        "b\"{'descr': '|S0', 'fortran_order': False, 'shape': (1099511627776,), }\".ljust(117) + b'\\n').decode()}"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PULLS))
def test_a_box_sending_a_hostile_value_is_refused_in_one_line(shell, capsys, case):
    """The box answers %box_pull with what it likes (here: its `display` replaced): a pickle, an npy header that lies
    about its shape or dtype, a column of another length, more than the limit. Each is refused in one line and
    nothing is assigned."""
    forged = HOSTILE_PULLS[case]
    assert shell.run_cell("%%box\nimport IPython.display as _d\n_real = _d.display\n"
                          "def _forge(obj, **kw):\n"
                          f"    _real({{'application/json': {{'tkbox-pull': {{'v': {forged}}}}}}}, raw=True)\n"
                          "_d.display = _forge\nv = 1").success
    capsys.readouterr()
    result = shell.run_cell("%box_pull v")
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert not result.success and "v" not in shell.user_ns, (case, text)
    lines = [x for x in text.splitlines() if x.strip()]
    assert len(lines) == 1 and "%box_pull" in lines[0] and "Traceback" not in text, (case, text)


def test_values_that_cannot_be_carried_exactly_are_refused_in_one_line(shell, capsys):
    """Never a silent change: a tuple, a MultiIndex, an object column of mixed types are refused naming why, in
    both directions."""
    import numpy as np
    import pandas as pd
    shell.user_ns["mixed"] = pd.DataFrame({"m": np.array([1, "a"], dtype=object)})
    shell.user_ns["pair"] = (1, 2)
    assert shell.run_cell("%%box\nimport pandas as pd\n"
                          "multi = pd.DataFrame({'a': [1], 'b': [2], 'c': [3]}).set_index(['a', 'b'])\n"
                          "pair = (1, 2)").success
    for cell, reason in (("%box_push mixed", "an object array holding int, str is not carried"),
                         ("%box_push pair", "builtins.tuple is not carried"),
                         ("%box_pull multi", "a MultiIndex is not carried"),
                         ("%box_pull pair", "builtins.tuple is not carried")):
        capsys.readouterr()
        result = shell.run_cell(cell)
        shown = capsys.readouterr()
        lines = [x for x in (shown.out + shown.err).splitlines() if x.strip()]
        assert not result.success and len(lines) == 1 and reason in lines[0], (cell, lines)
    assert "multi" not in shell.user_ns and shell.user_ns["pair"] == (1, 2)


def test_a_value_over_the_output_limit_is_refused_in_the_box_and_the_box_lives_on(shell, capsys):
    """A box's cell output over `[exec] max_output_bytes` ends the box: %box_pull of a value too big refuses it in the
    box first, in one line, and the box keeps its state."""
    assert shell.run_cell("%%box\nimport numpy as np\nhuge = np.zeros(3 << 20)").success
    capsys.readouterr()
    result = shell.run_cell("%box_pull huge")
    shown = capsys.readouterr()
    lines = [x for x in (shown.out + shown.err).splitlines() if x.strip()]
    assert not result.success and len(lines) == 1 and "over the %box_pull limit" in lines[0], lines
    assert shell.run_cell("%%box\nsmall = huge[:4]").success and shell.run_cell("%box_pull small").success
    assert shell.user_ns["small"].tolist() == [0.0] * 4


@pytest.mark.skipif(__import__("tkbox_nb.backends.gpus").backends.gpus.has_driver(),
                    reason="this host has an NVIDIA driver: a box with gpus would be given its GPU")
def test_box_policy_takes_gpus_and_a_host_without_a_gpu_refuses_its_box_in_one_line(shell, capsys, tmp_path):
    capsys.readouterr()
    assert shell.run_cell("%%box_policy\n[box]\ngpus = 1\n[exec]\ncells = true\n").success  # the text is a policy
    assert "set: the box starts with it" in capsys.readouterr().out
    result = shell.run_cell("%%box\nprint('never')")
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert not result.success and "never" not in shown.out
    assert [x for x in text.splitlines() if x.strip()] == [
        "GpuRefused: box.gpus: this host has no NVIDIA GPU or driver (no /dev/nvidiactl or no nvidia-smi)"], text
    assert not bundles(tmp_path)  # refused before any box started: no run, no bundle
    assert shell.run_cell("%%box_policy\n[exec]\ncells = true\n").success
    assert shell.run_cell("%%box\nprint('a box without gpus')").success
    assert "a box without gpus" in capsys.readouterr().out
