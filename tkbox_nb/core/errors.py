"""Error types. Each carries a message a user can act on; the CLI prints it as one line and exits non-zero."""


class TkboxError(Exception):
    """Base of every error this package raises on purpose."""

    exit_code = 2


class PolicyError(TkboxError):
    """A box policy that cannot be loaded or is not valid (names the file, the key and what is wrong)."""


class BundleError(TkboxError):
    """A `.tkb` that cannot be read at all: not a zip, over the limits, unsafe names. `tkbox verify` exits 2."""


class SignerError(TkboxError):
    """The machine signer could not be started, reached or read."""


class BoxEnded(TkboxError):
    """The box is gone (a limit, a protocol violation, the signer lost); the reason is recorded in its run."""

    exit_code = 1


class DoorRefused(TkboxError):
    """A crossing the door refused: by policy, by an invariant no policy lifts, or because the signer is gone."""

    exit_code = 1

    def __init__(self, message: str, rule_ids: tuple[str, ...] = ()):
        super().__init__(message)
        self.rule_ids = tuple(rule_ids)
