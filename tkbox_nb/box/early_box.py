"""A notebook's box started in the background (at the kernel's start, after %box_restart, or for a cell that needs
one), held until a cell takes it: the cell waits for it while the kernel answers its control channel.

A box that cannot even be made (no backend gives the policy's isolation, a signer it cannot name) is held as a failed
start, never raised where it happens: the Tracekit Box kernel starts its box before it serves kernel_info, and a
kernel that died there would be restarted by its frontend again and again; the first cell says why instead.
"""

from __future__ import annotations

import threading

from tkbox_nb.box.box import Box
from tkbox_nb.core.errors import TkboxError


class EarlyBox:
    """A box being started in the background, with its kernel (at the kernel's start, after %box_restart, or for a
    cell that needs one): held until a cell takes it or it is discarded. `wants`: what it was started with."""

    def __init__(self, box: Box | None, wants: tuple):
        self.box, self.wants = box, wants
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.released = threading.Event()
        if box is not None:
            threading.Thread(target=self._start, daemon=True, name="tkbox-early-box").start()

    @classmethod
    def failed(cls, error: BaseException, wants: tuple) -> "EarlyBox":
        """A box that could not even be made (the kernel must still answer kernel_info): its reason is the first
        cell's, with what to do."""
        early = cls(None, wants)
        early.error = error
        early.done.set()
        early.released.set()
        return early

    def _start(self) -> None:
        try:
            self.box.start()
            self.box.kernel()
        except BaseException as e:  # said on the first cell, which then fails closed
            self.error = e
        finally:
            self.done.set()
        # the box's processes die with the thread that started them (bwrap --die-with-parent, PR_SET_PDEATHSIG
        # follows the forking thread): this one lives until the box is stopped
        self.released.wait()

    def take(self, wants: tuple) -> Box | None:
        """The started box, or None when the notebook now asks for another one (it is then stopped unused). A box
        that failed to start raises its reason here, on the cell that needed it."""
        self.done.wait()
        if wants != self.wants:  # before its error: a start that failed under a policy since replaced is not news
            self._stop("not used: the notebook's policy or secrets changed before its first cell")
            return None
        if self.error is not None:
            self._stop("its start failed")
            raise self.error if isinstance(self.error, TkboxError) else TkboxError(
                f"the box did not start: {type(self.error).__name__}: {self.error}")
        return self.box

    def discard(self, reason: str) -> None:
        """Stop it unused (after its start has ended): its run is closed and bundled, never left open."""
        self.done.wait()
        self._stop(f"not used: {reason}")

    def _stop(self, reason: str) -> None:
        try:
            if self.box is not None:
                self.box.stop(reason)
        except TkboxError:
            pass
        finally:
            self.released.set()
