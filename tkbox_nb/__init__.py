"""tkbox-nb: notebook-native boxes for untrusted code, where every way out is decided and signed by Tracekit."""

from ._version import __version__
from .errors import BundleError, DoorRefused, PolicyError, SignerError, TkboxError
from .box import Box, BoxEnded, CellResult, CommandResult
from .policy import Policy
from .run import Run, open_run


def view(run_or_path, trust=None):
    """An ipywidgets view of one run: summary, timeline, filterable table, details and a Verify button."""
    from .widgets import view as _view
    return _view(run_or_path, trust=trust)


def load_ipython_extension(ip):  # `%load_ext tkbox_nb`
    from .magics import load_ipython_extension as load
    load(ip)


def unload_ipython_extension(ip):
    from .magics import unload_ipython_extension as unload
    unload(ip)


__all__ = ["__version__", "Box", "BoxEnded", "CellResult", "CommandResult", "Policy", "Run", "open_run", "TkboxError", "PolicyError", "BundleError", "SignerError",
           "DoorRefused", "view"]
