"""tkbox-nb: notebook-native boxes for untrusted code, where every way out is decided and signed by Tracekit."""

from tkbox_nb._version import __version__
from tkbox_nb.core.errors import BundleError, DoorRefused, PolicyError, SignerError, TkboxError
from tkbox_nb.box.box import Box, BoxEnded, CellResult, CommandResult
from tkbox_nb.policy import Policy
from tkbox_nb.bundle.read_back import Run, RunViews, open_run


def view(run_or_path, trust=None):
    """An ipywidgets view of one run: summary, timeline, filterable table, details and a Verify button."""
    from tkbox_nb.jupyter.run_view import view as _view
    return _view(run_or_path, trust=trust)


def _display_run(run):
    from tkbox_nb.jupyter.run_view import display_run
    display_run(run)


def _run_html(run):
    from tkbox_nb.jupyter.run_view import static_html
    return static_html(run)


def _run_notebook(run):
    from tkbox_nb.audit.replay import to_notebook
    return to_notebook(run)


# A Run is read below the modules that show it (widgets) and make it a notebook (replay), as they read runs: the top
# of the package hands them in (docs/layers.md). They are imported when first used: replay brings nbformat, which
# takes seconds to import.
Run.views = RunViews(display=_display_run, html=_run_html, notebook=_run_notebook)


def load_ipython_extension(ip):  # `%load_ext tkbox_nb`
    from tkbox_nb.jupyter.magics import load_ipython_extension as load
    load(ip)


def unload_ipython_extension(ip):
    from tkbox_nb.jupyter.magics import unload_ipython_extension as unload
    unload(ip)


__all__ = ["__version__", "Box", "BoxEnded", "CellResult", "CommandResult", "Policy", "Run", "open_run", "TkboxError",
           "PolicyError", "BundleError", "SignerError", "DoorRefused", "view"]
