"""The table of doors: every way out of a box, once, with what each part of tkbox needs to know of it.

A door's name used to be listed in six places that had to agree by hand (the recorder's door -> tool map, the door
of a tool in a bundle read back, the tools of the signer's box pack, the run view's doors, the policy's dispatch and
the audit's chain of doors), so adding a door meant finding all of them, and missing one failed quietly (a crossing
shown under its tool's name, a door the audit never counted). Each of them now reads this table, and a door's name is
spelled here only (the constants below); `tests/test_door_table.py` checks that a door added to the table is known
to each of them, and that no module outside it spells a door's name where it means the door, or a door's tool's
name (`tool_of(BOX, "start")` is what a box's start is signed as).

Per door: the Tracekit tool its crossings are signed as (and the kinds signed as another tool: a box's start), the
box policy section its verdict reads, how the run view names it, and how `tkbox audit` compares it (the section of
its facts, the categories its coverage line counts, the facts it compares). Pure data, and a few functions that
read it, each taking the table so a test can hand in a longer one.
"""

from __future__ import annotations

from dataclasses import dataclass

BOX = "box"
EXEC = "exec"
EGRESS = "egress"
SECRETS = "secrets"
MODEL = "model"
PATCH = "patch"
HOST = "host"
PACKAGES = "packages"

TOOL_PREFIX = "box."  # every door's tool; the box pack denies any other (unknown_tools: deny)


@dataclass(frozen=True)
class Counted:
    """One category of the audit's coverage line: its label and the kind of item it counts (None: every item of
    the door's section)."""

    label: str
    kind: str | None = None


@dataclass(frozen=True)
class Door:
    name: str
    tool: str  # what its crossings are signed as
    section: str | None  # the box policy section its verdict reads (None: it reads none, the host's own acts)
    label: str  # how the run view names it (its timeline's row)
    audit: str | None  # the section of the audit's facts its crossings go to (None: not compared one by one)
    counted: tuple[Counted, ...] = ()  # the audit's coverage categories
    compares: tuple[str, ...] = ()  # the statement's facts the audit compares (a door's own reader may add more)
    tool_of_kind: tuple[tuple[str, str], ...] = ()  # kinds signed as another tool than `tool`
    capped: bool = False  # its refusals are counted past [box] max_refusals (a box drives it), not each signed
    by: str | None = None  # the audit compares its last crossing per this fact, in that fact's order (else: in order)

    @property
    def tools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*(t for _, t in self.tool_of_kind), self.tool]))


TABLE: tuple[Door, ...] = (
    Door(BOX, "box.stop", "box", BOX, "box", tool_of_kind=(("start", "box.start"),)),
    Door(EXEC, "box.exec", "exec", EXEC, "exec", (Counted("exec cells", "cell"), Counted("exec commands", "command")),
         ("code", "outputs", "user_expressions", "argv", "cwd", "env_names", "stdin", "timeout_s", "exit_code",
          "stdout", "stderr"), capped=True),
    Door(EGRESS, "box.connect", "egress", EGRESS, "egress", (Counted("egress"),),
         ("method", "host", "port", "rule"), capped=True),
    Door(SECRETS, "box.secret", "secrets", SECRETS, "secrets (names only)", (Counted("secrets"),),
         ("kind", "name", "host"), capped=True),
    Door(MODEL, "box.model", "models", MODEL, "model calls", (Counted("model calls"),),
         ("provider", "model", "endpoint", "rule", "request", "response"), capped=True),
    Door(PATCH, "box.patch", "patch", PATCH, "patch", (Counted("patch files"),),
         ("op", "path", "from", "type", "target", "mode", "rule", "content"), by="path"),
    Door(HOST, "box.host", None, HOST, "host magics", (Counted("host magics"),), ("magic", "line", "body", "policy")),
    Door(PACKAGES, "box.packages", "packages", PACKAGES, "packages", (Counted("package files"),),
         ("project", "filename", "version", "sha256", "size"), capped=True),
)


def names(table: tuple[Door, ...] = TABLE) -> tuple[str, ...]:
    return tuple(d.name for d in table)


def door(name: object, table: tuple[Door, ...] = TABLE) -> Door | None:
    return next((d for d in table if d.name == name), None)


def tool_of(name: str, kind: object, table: tuple[Door, ...] = TABLE) -> str:
    """The tool a crossing of door `name` and `kind` is signed as; a door not in the table is `box.NAME`, which the
    box pack denies."""
    d = door(name, table)
    if d is None:
        return TOOL_PREFIX + name
    return dict(d.tool_of_kind).get(kind, d.tool) if isinstance(kind, str) else d.tool


def door_of_tool(table: tuple[Door, ...] = TABLE) -> dict[str, str]:
    """Each tool -> its door (a crossing read back whose statement names no door)."""
    return {t: d.name for d in table for t in d.tools}


def tools(table: tuple[Door, ...] = TABLE) -> tuple[str, ...]:
    """Every door's tools, in table order: what the box pack allows."""
    return tuple(t for d in table for t in d.tools)


def capped(table: tuple[Door, ...] = TABLE) -> tuple[str, ...]:
    """The doors whose refusals past [box] max_refusals are counted, not each signed."""
    return tuple(d.name for d in table if d.capped)


def check(table: tuple[Door, ...] = TABLE) -> None:
    """The table is one: names, tools and audit labels unique, every tool under TOOL_PREFIX. ValueError if not."""
    for what, values in (("door", names(table)), ("tool", tools(table)),
                         ("audit category", [c.label for d in table for c in d.counted])):
        twice = sorted({v for v in values if list(values).count(v) > 1})
        if twice:
            raise ValueError(f"the door table names the {what} {', '.join(twice)} twice")
    outside = [t for t in tools(table) if not t.startswith(TOOL_PREFIX)]
    if outside:
        raise ValueError(f"the door table's tools {', '.join(outside)} are not under {TOOL_PREFIX}")


check()
