"""The door stream codec, shared by both sides: the host imports it from here, the guest as tkbox_guest.protocol."""

from .guest.protocol import *  # noqa: F401,F403
from .guest.protocol import ProtocolError  # noqa: F401
