"""The exec door: commands and cells into the box, each only after a signed allow.

Before a command or a cell goes in, the run gets a signed decision under the box policy; nothing runs without a
signed allow. A command's exit status and output come back strictly (integer status, stdout and stderr only, at
most `exec.max_output_bytes` together) and are signed as its result, with the output spooled for the bundle. A
cell's result is signed by the host end of the box's kernel (doors/cell.py), which alone knows when it has ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tkbox_nb.guest import protocol as p
from tkbox_nb.core.errors import BoxEnded, DoorRefused, TkboxError
from tkbox_nb.doors.door import Door
from tkbox_nb.rules.door_table import EXEC

if TYPE_CHECKING:
    from tkbox_nb.signing.recorder import Crossing
    from tkbox_nb.doors.context import DoorContext


# What a process's end can be: its exit status (0..255), or minus the signal that killed it (Linux has 64 signals,
# 127 on MIPS). Anything else from the box is a violation, never signed.
EXIT_MIN, EXIT_MAX = -127, 255


@dataclass
class CommandResult:
    exit_code: int
    stdout: bytes
    stderr: bytes


class ExecDoor(Door):
    """The exec door of one box, which it sees as a DoorContext. It has nothing to start or end: each crossing is
    one exchange (doors/exec_transport.py), over when it returns."""

    name = "exec"

    def __init__(self, box: "DoorContext"):
        self.box = box

    def decide(self, kind: str, facts: dict, content: dict[str, bytes]) -> "Crossing":
        """A signed allow for one crossing, or DoorRefused; a refusal because the signer is gone ends the box."""
        box = self.box
        crossing = box.recorder.decide(EXEC, kind, facts, content)
        if not crossing.allowed:
            if box.recorder.broken:  # the signer is gone: the box goes too
                box.fail_closed(f"signer lost: {box.recorder.broken}")
            why = crossing.verdict.reason if not crossing.verdict.allowed else crossing.reason
            raise DoorRefused(f"exec refused ({', '.join(crossing.rule_ids) or crossing.decision}): {why}",
                              crossing.rule_ids)
        return crossing

    def run(self, argv: list[str], stdin: bytes | None = None, timeout: float | None = None,
            cwd: str | None = None, env: dict[str, str] | None = None) -> CommandResult:
        """Run `argv` in the box after a signed allow; its exit status and output, signed as its result."""
        if not (isinstance(argv, (list, tuple)) and argv and all(isinstance(a, str) for a in argv)):
            raise TkboxError("argv must be a non-empty list of strings")
        if cwd is not None and not (isinstance(cwd, str) and cwd.startswith("/") and "\0" not in cwd):
            raise TkboxError("cwd must be an absolute path in the box")
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and k and "=" not in k and "\0" not in k and isinstance(v, str) and "\0" not in v
                for k, v in env.items())):
            raise TkboxError("env must map variable names to strings")
        facts: dict[str, Any] = {"argv": list(argv), **({"cwd": cwd} if cwd is not None else {}),
                                 **({"env_names": sorted(env)} if env else {})}
        if timeout is not None:  # an integral float as an int: the record's canonical JSON has one form for it
            facts["timeout_s"] = int(timeout) if float(timeout).is_integer() else float(timeout)
        crossing = self.decide("command", facts, {"stdin": stdin} if stdin else {})
        box = self.box
        timeout = timeout if timeout is not None else box.policy.get("exec", "timeout_s")
        limit = box.policy.get("exec", "max_output_bytes")
        out = {p.CH_STDOUT: bytearray(), p.CH_STDERR: bytearray()}
        request = {"kind": "command", "argv": list(argv), **({"cwd": cwd} if cwd is not None else {}),
                   **({"env": dict(env)} if env else {})}
        kills = box.memory_kills()
        body = box.exchange(request, timeout, lambda ch, data: _append(out, ch, data, limit), stdin)
        code = body.get("exit_code")
        if not isinstance(code, int) or isinstance(code, bool) or not EXIT_MIN <= code <= EXIT_MAX:
            box.fail_closed("door protocol violation: the box answered a command without an exit status a "
                            f"process can have ({str(code)[:40]})")
            raise BoxEnded(f"the box has ended: {box.ended}")
        stdout, stderr = bytes(out[p.CH_STDOUT]), bytes(out[p.CH_STDERR])
        result: dict[str, Any] = {"exit_code": code}
        if code < 0 and box.memory_kills() > kills:  # the host's count, never the box's word
            result["killed_by"] = "memory limit"
        if not box.recorder.complete(crossing, "ok" if code == 0 else "error", result,
                                     {"stdout": stdout, "stderr": stderr}):
            box.fail_closed(f"the command's result was not signed: {box.recorder.broken or 'the run is closed'}")
            raise BoxEnded(f"the box has ended: {box.ended}")
        return CommandResult(code, stdout, stderr)

    def decide_cell(self, code: str, user_expressions: dict[str, str] | None = None) -> "Crossing":
        """The exec door for one cell: a signed allow, or DoorRefused (and nothing goes into the box). The
        user_expressions the box will evaluate after it (already read strictly) are decided with its code: the
        decision commits to them (`user_expressions`, canonical JSON) only when there are any, so a cell without
        them is stated exactly as before."""
        if not isinstance(code, str):
            raise TkboxError("code must be a string")
        content = {"code": code.encode("utf-8")}
        if user_expressions:
            content["user_expressions"] = json.dumps(user_expressions, sort_keys=True, ensure_ascii=False,
                                                     separators=(",", ":")).encode("utf-8")
        return self.decide("cell", {}, content)


def _append(out: dict[int, bytearray], channel: int, data: bytes, limit: int) -> None:
    if channel not in out:
        raise p.ProtocolError(f"command output on channel {channel}")
    if len(out[p.CH_STDOUT]) + len(out[p.CH_STDERR]) + len(data) > limit:
        raise p.ProtocolError(f"command output over exec.max_output_bytes ({limit})")
    out[channel] += data
