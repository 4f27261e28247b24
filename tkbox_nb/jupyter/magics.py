"""The IPython extension (`%load_ext tkbox_nb`): send some cells of an ordinary notebook into a box.

`%%box` runs its cell in the notebook's box through the exec door (the box starts on first use and keeps its state
across cells; `%%box --new` starts a fresh one) and shows the box's outputs in place: streams as they come, rich
display, and errors with the box's own traceback. `%box_push NAME ...` and `%box_pull NAME ...` move values
between the host's namespace and the box's, each as a cell through the exec door, so every move is decided and signed
like any other: plain data as JSON (None, booleans, numbers, strings, lists, dicts), numpy arrays, DataFrames and
Series as `.npy` arrays with a strict header (rules/value_codec.py, never pickle), read back exactly or refused.

The host-side magics (`%box_policy`, `%%box_policy`, `%box_secret`, `%box_status`, `%box_bundle`, `%box_restart`)
are notebook_box.HostMagics, the same code the Tracekit Box kernel runs. `%box_secret` reads the value with getpass on
the host: it never enters the notebook, its outputs, the history, the box or the bundle.

Unloading the extension, or the kernel's exit, stops the box and writes its bundle.
"""

from __future__ import annotations

import atexit
import functools
import getpass
import json
import sys
from pathlib import Path
from typing import Any

from tkbox_nb.rules import value_codec
from tkbox_nb.rules.output_sanitiser import box_display_id
from tkbox_nb.core.errors import TkboxError
from tkbox_nb.jupyter.magics_cell import BoxCell, pull_refusal
from tkbox_nb.box.notebook_box import HOST_MAGICS, HostMagics, NotebookBox

MAX_PULL_BYTES = 16 << 20
_PULL_MARK = "tkbox-pull"


class BoxCellError(Exception):
    """A %%box cell that failed in the box: IPython shows the box's traceback, not the host's."""

    def __init__(self, ename: str, evalue: str, traceback: list[str]):
        super().__init__(f"{ename}: {evalue}")
        self.box_traceback = traceback

    def _render_traceback_(self) -> list[str]:
        return self.box_traceback


class BoxInterrupted(KeyboardInterrupt):
    """A %%box cell (or a move) interrupted on the host: the box's cell was sent an interrupt too, and nothing more of
    it is shown (magics_cell.BoxCell). Shown as one line, not the host's frames."""

    LINE = ("KeyboardInterrupt: the box's cell was interrupted too; what it still sends is signed in the run, "
            "not shown here")

    def _render_traceback_(self) -> list[str]:
        return [self.LINE]


class MagicError(Exception):
    """A host-side magic that failed (bad input, a refusal, a file it cannot write): the cell fails, shown as one
    line, never the host's traceback."""

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


def _one_line(fn):
    """`fn`, a magic, whose TkboxError or OSError fails its cell in one line."""
    def magic(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TkboxError, OSError) as e:
            raise MagicError(f"{type(e).__name__}: {e}") from None
    magic.__name__, magic.__doc__ = fn.__name__, fn.__doc__
    return magic


def _show(box_id: str, output: dict[str, Any]) -> None:
    """One box output, shown in place by the host kernel (already checked by jupyter_messages). The box's display ids
    are namespaced (output_sanitiser.box_display_id): a box updates only its own displays, never one of this
    kernel's."""
    from IPython.display import display
    t = output["output_type"]
    if t == "stream":
        stream = sys.stdout if output["name"] == "stdout" else sys.stderr
        stream.write(output["text"])
        stream.flush()
    elif t in ("display_data", "execute_result"):
        shown = box_display_id(box_id, output["display_id"]) if output.get("display_id") else None
        display(output["data"], raw=True, metadata=output.get("metadata") or None, display_id=shown)
    elif t == "update_display_data" and output.get("display_id"):
        display(output["data"], raw=True, metadata=output.get("metadata") or None,
                display_id=box_display_id(box_id, output["display_id"]), update=True)
    elif t == "clear_output":
        from IPython.display import clear_output
        clear_output(wait=output.get("wait", False))


class BoxMagicsExtension:
    """What `%load_ext tkbox_nb` registers on one shell."""

    def __init__(self, shell, nb: NotebookBox | None = None):
        self.shell = shell
        self.nb = nb or NotebookBox()
        # getpass is looked up late: ipykernel swaps it per cell
        self.host = HostMagics(self.nb, lambda prompt: getpass.getpass(prompt))

    def register(self) -> None:
        ip = self.shell
        ip.register_magic_function(_one_line(self.box_cell), "cell", "box")
        ip.register_magic_function(_one_line(self.box_push), "line", "box_push")
        ip.register_magic_function(_one_line(self.box_pull), "line", "box_pull")
        for name in HOST_MAGICS:
            kind = "line_cell" if name == "box_policy" else "line"
            ip.register_magic_function(self._host(name), kind, name)

    def _host(self, name: str):
        def magic(line: str, cell: str | None = None):
            try:
                text = self.host.run(name, line.strip(), cell)
                if isinstance(text, Path):  # %box_view: the run, as the widget view
                    from tkbox_nb.jupyter.run_view import view
                    return view(text)
            except (TkboxError, OSError) as e:  # a bad bundle, a path it cannot write: one line
                print(f"{type(e).__name__}: {e}", file=sys.stderr)
                return None
            print(text)
        magic.__name__ = name
        magic.__doc__ = f"%{name}: a host-side tkbox magic (docs/jupyter.md); never enters the box."
        return magic

    # -- %%box ---------------------------------------------------------------------------------------------------
    def box_cell(self, line: str, cell: str):
        """%%box [--new]: run this cell in the notebook's box (decided and signed by the exec door)."""
        args = line.split()
        if any(a != "--new" for a in args):
            print(f"UsageError: %%box takes only --new, not {' '.join(a for a in args if a != '--new')}",
                  file=sys.stderr)
            return
        if "--new" in args:
            path = self.nb.stop("a fresh box (%%box --new)")
            if path:
                print(f"[tkbox] previous box's bundle: {path}", file=sys.stderr)
        try:
            result = self._execute(cell, _show)
        except TkboxError as e:  # refused by the door, or the box ended: one line, no host traceback
            raise BoxCellError(type(e).__name__, str(e), [f"{type(e).__name__}: {e}"]) from None
        if result.status != "ok":
            error = next((o for o in result.outputs if o["output_type"] == "error"), None)
            if error is not None:
                raise BoxCellError(error["ename"], error["evalue"], error["traceback"])
            raise BoxCellError("BoxError", f"the cell ended with status {result.status}", [])

    def _execute(self, code: str, on_output):
        """Run `code` in the box: Box.execute in a thread of its own, its outputs shown from this one (the cell's,
        under its own parent) as they come. An interrupt of this cell interrupts the box's cell and shows nothing
        more of it; the thread keeps watching it, so `[exec] timeout_s` ends it even if no later cell comes."""
        box = self.nb.ensure_box()
        try:
            box.kernel()  # started (and waited for) from this thread, as before: only the cell moves to the thread
            cell = BoxCell(box, code, on_output is not None)
            try:
                kind, value = cell.wait(lambda out: on_output(box.box_id, out))
            except KeyboardInterrupt:
                cell.interrupt()
                raise BoxInterrupted() from None
            if kind == "error":
                raise value
            return value
        except TkboxError:
            if not self.nb.live:  # the box ended: say so, the next %%box starts a new one
                self.nb.stop("the box ended")
            raise

    # -- moving values ---------------------------------------------------------------------------------------
    def box_push(self, line: str):
        """%box_push NAME [NAME ...]: copy values (plain JSON data, numpy arrays, DataFrames, Series) from this
        namespace into the box's."""
        names = line.split()
        if not names:
            raise TkboxError("%box_push: name the variables to push")
        plain, coded = [], {}
        for name in names:
            if not name.isidentifier():
                raise TkboxError(f"%box_push: {name!r} is not a name")
            if name not in self.shell.user_ns:
                raise TkboxError(f"%box_push: no variable {name} here")
            value = self.shell.user_ns[name]
            if value_codec.is_plain(value):  # as before: one json.loads per name
                plain.append(f"{name} = __import__('json').loads({json.dumps(value)!r})")
                continue
            try:
                coded[name] = json.dumps(value_codec.encode(value))
            except value_codec.ValueCodecError as e:
                raise TkboxError(f"%box_push: {name} is not plain data, a numpy array, a DataFrame or a Series: "
                                 f"{e}") from None
        if sum(len(c) for c in coded.values()) > MAX_PULL_BYTES:
            raise TkboxError(f"%box_push: more than {MAX_PULL_BYTES} bytes")
        code = "\n".join(plain)
        if coded:
            code += ("\ndef _tkbox_push(entries):\n    ns = {'__name__': 'tkbox_values'}\n"
                     f"    exec({_codec_source()!r}, ns)\n"
                     f"    return {{n: ns['decode'](__import__('json').loads(e), {MAX_PULL_BYTES}) "
                     "for n, e in entries.items()}\n"
                     f"try:\n    globals().update(_tkbox_push({coded!r}))\nfinally:\n    del _tkbox_push")
        result = self._execute(code, None)
        if result.status != "ok":
            error = next((o for o in result.outputs if o["output_type"] == "error"), {})
            raise TkboxError(f"%box_push: the box refused the values ({error.get('ename', result.status)}: "
                             f"{str(error.get('evalue', ''))[:200]})")

    def box_pull(self, line: str):
        """%box_pull NAME [NAME ...]: copy values (plain JSON data, numpy arrays, DataFrames, Series) from the box's
        namespace into this one, each read back exactly or refused."""
        names = line.split()
        if not names or not all(n.isidentifier() for n in names):
            raise TkboxError("%box_pull: name the variables to pull")
        for name in names:
            why = pull_refusal(name, self.shell.user_ns_hidden)
            if why:
                raise TkboxError(f"%box_pull: {name} {why}; not replaced")
        code = ("def _tkbox_pull(names):\n    ns = {'__name__': 'tkbox_values'}\n"
                f"    exec({_codec_source()!r}, ns)\n"
                "    out = {n: ns['encode'](globals()[n]) for n in names}\n"
                f"    if len(__import__('json').dumps(out)) > {self._pull_cap()}:\n"
                "        raise ns['ValueCodecError'](\n"
                f"            'the values are over the %box_pull limit of {self._pull_cap()} bytes of JSON')\n"
                "    return out\n"
                "try:\n    __import__('IPython.display').display.display("
                f"{{'application/json': {{{_PULL_MARK!r}: _tkbox_pull({names!r})}}}}, raw=True)\n"
                "finally:\n    del _tkbox_pull")
        result = self._execute(code, None)
        if result.status != "ok":
            error = next((o for o in result.outputs if o["output_type"] == "error"), {})
            raise TkboxError(f"%box_pull: {error.get('ename', 'error')}: {error.get('evalue', result.status)}")
        values = _pulled(result.outputs, names)
        self.shell.user_ns.update(values)

    def _pull_cap(self) -> int:
        """What the box may send: a cell's outputs over `[exec] max_output_bytes` end the box, so the box's side of
        %box_pull refuses before that (with room for the message around the values)."""
        cap = self.nb.ensure_box().policy.get("exec", "max_output_bytes")
        return max(0, min(MAX_PULL_BYTES, int(cap)) - (64 << 10))

    def unload(self) -> None:
        path = self.nb.stop("extension unloaded")
        if path:
            print(f"[tkbox] box stopped; its bundle: {path}")


def _pulled(outputs: list[dict], names: list[str]) -> dict[str, Any]:
    """The pulled values, read strictly from the box's output (hostile input: size, shape, names; each value by
    rules/value_codec.decode)."""
    for out in outputs:
        data = out.get("data", {}).get("application/json") if out["output_type"] == "display_data" else None
        if isinstance(data, dict) and set(data) == {_PULL_MARK}:
            values = data[_PULL_MARK]
            if not isinstance(values, dict) or set(values) != set(names):
                raise TkboxError("%box_pull: the box answered with other names than asked")
            if len(json.dumps(values)) > MAX_PULL_BYTES:
                raise TkboxError(f"%box_pull: more than {MAX_PULL_BYTES} bytes")
            try:
                return {name: value_codec.decode(values[name], MAX_PULL_BYTES) for name in names}
            except value_codec.ValueCodecError as e:
                raise TkboxError(f"%box_pull: the box's value is refused: {e}") from None
    raise TkboxError("%box_pull: the box did not answer with the values")


@functools.cache
def _codec_source() -> str:
    """rules/value_codec.py's own text, run in the box (in a namespace of its own) to encode and decode there."""
    return Path(value_codec.__file__).read_text()


_loaded: dict[int, BoxMagicsExtension] = {}


def load_ipython_extension(ip) -> None:
    if id(ip) in _loaded:
        return
    ext = _loaded[id(ip)] = BoxMagicsExtension(ip)
    ext.register()
    atexit.register(ext.unload)


def unload_ipython_extension(ip) -> None:
    ext = _loaded.pop(id(ip), None)
    if ext is not None:
        atexit.unregister(ext.unload)
        ext.unload()
