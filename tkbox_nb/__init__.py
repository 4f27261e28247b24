"""tkbox-nb: notebook-native boxes for untrusted code, where every way out is decided and signed by Tracekit."""

__version__ = "0.1.0"

from .errors import BundleError, DoorRefused, PolicyError, SignerError, TkboxError  # noqa: E402
from .box import Box, BoxEnded, CellResult, CommandResult  # noqa: E402
from .policy import Policy  # noqa: E402
from .run import Run, open_run  # noqa: E402

__all__ = ["__version__", "Box", "BoxEnded", "CellResult", "CommandResult", "Policy", "Run", "open_run", "TkboxError", "PolicyError", "BundleError", "SignerError",
           "DoorRefused"]
