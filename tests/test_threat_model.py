"""docs/threat-model.md names tests for each invariant: each invariant names at least one, and each named one exists
(a test function of that name in that file, or a whole file of tests). The code its "why it holds" column names
exists too, so a move or rename that leaves a row naming code that is gone fails here, naming the row."""

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF = re.compile(r"`((?:tests/[\w/]+\.py)?::\w+|tests/[\w/]+\.py)`")


def invariants(root: Path = ROOT) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """(invariant id, [(test file, test name or None for the whole file)]) for each row of the table; a `::name`
    belongs to the file named last before it in the same row."""
    rows = []
    for line in (root / "docs" / "threat-model.md").read_text().splitlines():
        m = re.match(r"\| *(I\d+) *\|", line)
        if not m:
            continue
        tests_cell = line.rstrip().rstrip("|").rsplit("|", 1)[1]
        refs, module = [], None
        for ref in REF.findall(tests_cell):
            if ref.startswith("tests/"):
                module, _, name = ref.partition("::")
                refs.append((module, name or None))
            else:
                refs.append((module or "(no file named before it)", ref.lstrip(":")))
        rows.append((m.group(1), refs))
    return rows


def problems(root: Path = ROOT) -> list[str]:
    out = []
    for invariant, refs in invariants(root):
        if not refs:
            out.append(f"{invariant} names no test")
        for module, name in refs:
            path = root / module
            if not path.is_file():
                out.append(f"{invariant}: {module} does not exist")
            elif name is None and not re.search(r"^def test_\w+\(", path.read_text(), re.M):
                out.append(f"{invariant}: {module} holds no test")
            elif name is not None and not re.search(rf"^\s*def {name}\(", path.read_text(), re.M):
                out.append(f"{invariant}: {module}::{name} is named in the threat model but missing")
    return out


def test_every_invariant_names_a_test_and_every_named_test_exists():
    ids = [i for i, _ in invariants()]
    # ids are unique and in order; a gap is allowed, as ids are handed out in blocks to work done in parallel
    numbers = [int(i[1:]) for i in ids]
    assert len(ids) >= 50 and numbers[:58] == list(range(1, 59)) and numbers == sorted(set(numbers))
    assert problems() == []


def test_the_check_sees_a_missing_test_and_a_row_without_one(tmp_path):
    """The check itself, on a made-up table: a name its file does not define, a row naming no test."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "docs" / "threat-model.md").write_text(
        "| I1 | a | b | `tests/test_x.py::test_here`, `::test_gone` |\n| I2 | a | b | nothing named |\n"
        "| I3 | a | b | every test in `tests/test_x.py`, `tests/test_y.py` |\n")
    assert problems(tmp_path) == ["I1: tests/test_x.py::test_gone is named in the threat model but missing",
                                  "I2 names no test", "I3: tests/test_y.py does not exist"]


# The "why it holds" column names code in backticks. A token counts as code when, less a call's `(...)`, it is a
# dotted or bare Python name or a path of one (letters, digits, `_`, `.`, `/`) and is CamelCase, holds a `_`, a `.`
# or a `/`, or ends in `.py` or `()`; a bare lowercase word (`verify`, `plan`) is too often a value or plain English
# to check, and anything with a space, `-`, `%`, `$`, `[`, `:`, `=` or `*` is a command, flag, magic, policy key or
# box path. What is left and still names no code of this package is here, each with why.
NOT_OURS = {
    "box.start": "a tool name the box signs its start under, not a module",
    "box.stop": "a tool name the box signs its stop under, not a module",
    "K_size": "a field of Tracekit's signed statements",
    "environment_size": "that field for `environment`: the recorder makes its name, `key + \"_size\"`",
    "parent_header.msg_id": "a field of a Jupyter message",
    "memory.max": "a cgroup v2 interface file",
    "memory.limit_in_bytes": "a cgroup v1 interface file",
}
# system names: open(2) flags, prctl(2) options, resource limits, clone(2) flags
SYSTEM_PREFIXES = ("O_", "PR_", "RLIMIT_", "CLONE_")
# a file's name (a bundle's entry, `box/patch.diff`; a file in a box or the signer's store, `pyvenv.cfg`), not code
FILE_SUFFIXES = (".json", ".jsonl", ".diff", ".cfg", ".toml", ".txt", ".md")
BACKTICKED = re.compile(r"`([^`]+)`")
CODE_TOKEN = re.compile(r"[A-Za-z_][\w]*(?:[./][A-Za-z_]\w*)*(?:\.py)?")


def code_token(token: str) -> str | None:
    """The name a backticked token names as code, less a call's arguments, or None for what is not code."""
    call = re.fullmatch(r"(.+?)\((.*)\)", token)
    name = call.group(1) if call else token
    if (token in NOT_OURS or name.startswith(SYSTEM_PREFIXES) or name.endswith(FILE_SUFFIXES)
            or not CODE_TOKEN.fullmatch(name)):
        return None
    camel = re.search(r"[a-z]", name) and re.search(r"[A-Z]", name)
    if call or camel or "_" in name or "." in name or "/" in name:
        return name
    return None


def why_cells(root: Path = ROOT) -> list[tuple[str, str]]:
    """(invariant id, its "why it holds" cell) for each row; `\\|` inside a cell is not a column."""
    rows = []
    for line in (root / "docs" / "threat-model.md").read_text().splitlines():
        m = re.match(r"\| *(I\d+) *\|", line)
        if m:
            rows.append((m.group(1), re.split(r"(?<!\\)\|", line)[3]))
    return rows


class Names:
    """What a package defines, by an ast scan (nothing is imported): each module by its dotted name, and in each the
    names it defines at the top (classes, functions, constants and imported names excluded), each class's members
    (methods, class attributes, attributes its methods set on `self`, and its bases' by name); a function's locals and
    parameters are not names it defines."""

    def __init__(self, packages: list[Path]):
        self.modules: dict[tuple[str, ...], dict[str, dict]] = {}
        self.files: dict[Path, dict[str, dict]] = {}
        self.classes: dict[str, list[dict]] = {}
        self.everywhere: set[str] = set()
        self.strings: set[str] = set()
        for package in packages:
            for path in sorted(package.rglob("*.py")):
                parts = (package.name, *path.relative_to(package).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                tree = ast.parse(path.read_text(), str(path))
                self.modules[parts] = self.files[path.resolve()] = self._scan(tree.body)
                self.strings.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                                    and isinstance(n.value, str) and n.value.isidentifier())
        for package in packages:        # a package folder without an __init__.py is still a module path
            for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
                self.modules.setdefault((package.name, *folder.relative_to(package).parts), {})

    def _scan(self, body: list[ast.stmt]) -> dict[str, dict]:
        names: dict[str, dict] = {}
        for node in body:
            if isinstance(node, ast.ClassDef):
                members = self._scan(node.body)
                for sub in ast.walk(node):
                    targets = (sub.targets if isinstance(sub, ast.Assign)
                               else [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                    for target in targets:
                        for t in ast.walk(target):
                            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                    and t.value.id == "self"):
                                members.setdefault(t.attr, {})
                entry = {"members": members, "bases": [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                                                       for b in node.bases]}
                names[node.name] = entry
                self.classes.setdefault(node.name, []).append(entry)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = {}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            names[t.id] = {}
            elif isinstance(node, (ast.If, ast.Try, ast.With)):     # definitions under `if`, `try:` or `with`
                for block in ("body", "orelse", "finalbody"):
                    names.update(self._scan(getattr(node, block, [])))
                for handler in getattr(node, "handlers", []):
                    names.update(self._scan(handler.body))
        for name in names:
            self.everywhere.add(name)
        return names

    def _members(self, entry: dict, seen: frozenset = frozenset()) -> dict[str, dict]:
        members = dict(entry.get("members", {}))
        for base in entry.get("bases", []):
            if base not in seen:
                for other in self.classes.get(base, []):
                    members = {**self._members(other, seen | {base}), **members}
        return members

    def _within(self, names: dict[str, dict], rest: list[str]) -> bool:
        if not rest:
            return True
        entry = names.get(rest[0])
        if entry is None:
            return False
        return len(rest) == 1 or self._within(self._members(entry), rest[1:])

    def in_file(self, path: Path, dotted: str) -> bool:
        """What a module file (of the package or not) defines, by its dotted name there."""
        names = self.files.get(path.resolve())
        if names is None:
            names = self.files[path.resolve()] = self._scan(ast.parse(path.read_text(), str(path)).body)
        return self._within(names, dotted.split(".") if dotted else [])

    def resolves(self, dotted: str) -> bool:
        """A module by its dotted name or a dotted suffix of it, then what it defines; or a class and its members,
        or a bare name any module or class defines (not an attribute set on `self`: bare, too many are alike)
        or a string the code uses whole (a field of a signed statement, `addresses_dropped`; a magic's name)."""
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            head = tuple(parts[:k])
            for module, names in self.modules.items():
                if module[-k:] == head and self._within(names, parts[k:]):
                    return True
        if len(parts) == 1:
            return parts[0] in self.everywhere or parts[0] in self.strings
        return any(self._within(self._members(entry), parts[1:]) for entry in self.classes.get(parts[0], []))


def stale_code(root: Path = ROOT) -> list[str]:
    """Each code name a row's "why it holds" names that the package does not define, as `I1: name`. A path (with a
    `/` or ending in `.py`) must exist under the package or the repository, and what follows its module (`.name`)
    must be defined there; `tracekit.` names are looked up in the installed Tracekit."""
    spec = importlib.util.find_spec("tracekit")
    packages = [root / "tkbox_nb"] + ([Path(spec.origin).parent] if spec and spec.origin else [])
    names = Names(packages)
    out = []
    for invariant, cell in why_cells(root):
        for token in BACKTICKED.findall(cell):
            name = code_token(token)
            if name is None:
                continue
            if "/" in name or name.endswith(".py"):
                path, _, attr = name.removesuffix(".py").partition(".")
                files = [f for base in (root / "tkbox_nb", root)
                         for f in (base / f"{path}.py", base / path / "__init__.py") if f.is_file()]
                ok = bool(files) and names.in_file(files[0], attr)
            else:
                ok = names.resolves(name)
            if not ok:
                out.append(f"{invariant}: {token}")
    return out


def test_every_code_name_in_why_it_holds_is_defined():
    """A module, class or function the threat model gives as the reason an invariant holds exists (after a move,
    the row names it where it is now)."""
    assert stale_code() == []


def test_the_code_check_sees_a_made_up_name_and_passes_real_ones(tmp_path):
    """The resolver itself, on a made-up table against the real package: what exists passes, in each form the table
    uses, and a name or path that does not fails; tool names, flags and system names are not code."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "tkbox_nb").symlink_to(ROOT / "tkbox_nb")
    (tmp_path / "fuzz").symlink_to(ROOT / "fuzz")
    real = ("`RunRecorder.decide`, `MachineSigner`, `archive.read_entries`, `signing.recorder`, "
            "`backends/memory_limit.py`, `fuzz/targets.py`, `policy/egress.decide`, `MAX_CELL_MESSAGES`, "
            "`tree_digest(exclude=...)`, `Box`, `tracekit.bundle_v2.export`, `box.start`, `RLIMIT_AS`, `O_EXCL`, "
            "`--disable-userns`, `[box] max_refusals`, `tkbox verify`, `0700`, `fuzz/targets.frame_decoder`, "
            "`box/patch.diff`, `jupyter/kernel/relay.rebuilt`, `jupyter_messages`, `Box(model_replay=PATH)`, "
            "`Box.replay_of`")  # the last, an attribute Box sets on self
    assert [code_token(t) for t in ("box.start", "RLIMIT_AS", "verify", "tree_digest(exclude=...)", "K_size")] == [
        None, None, None, "tree_digest", None]
    (tmp_path / "docs" / "threat-model.md").write_text(
        f"| I1 | a | {real} | t |\n"
        "| I2 | a | `box_outputs.mimebundle`, `RunRecorder.no_such_method`, `NoSuchClass`, `doors/gone.py`, "
        "`bundle.read_entries`, `policy/egress.no_such`, `made_up()`, `fuzz/targets.gone`, `kernel/relay.rebuilt`, "
        "`box_messages` | t |\n")
    assert stale_code(tmp_path) == ["I2: box_outputs.mimebundle", "I2: RunRecorder.no_such_method",
                                    "I2: NoSuchClass", "I2: doors/gone.py", "I2: bundle.read_entries",
                                    "I2: policy/egress.no_such", "I2: made_up()", "I2: fuzz/targets.gone",
                                    "I2: kernel/relay.rebuilt", "I2: box_messages"]
