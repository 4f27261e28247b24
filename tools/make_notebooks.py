"""Writes notebooks/02, 04 and 05 from the cells below (kept here so a change to them is a reviewable diff)."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent.parent / "notebooks"
TKBOX = {"kernelspec": {"display_name": "Python 3 (Tracekit Box)", "language": "python", "name": "tkbox"},
         "language_info": {"name": "python"}}
PY3 = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
       "language_info": {"name": "python"}}

NB02 = [
    new_markdown_cell(
        "# 02 · Policy and secrets\n\n"
        "Shows: a policy set from the notebook (an egress allow list), a request to the cloud metadata address refused "
        "and signed with its rule, a request to a host off the list refused before any name lookup, and a secret bound "
        "to one host: the box only ever sees a placeholder, which the host would swap for the value only in the "
        "`Authorization` header of HTTPS requests to that host.\n\n"
        "Needs: bubblewrap, `tkbox kernel install`, and the host environment variable `TKBOX_DEMO_TOKEN` (any value; "
        "`make test` sets one). Runs offline: nothing here reaches a network."),
    new_code_cell('%%box_policy\n[egress]\nallow = ["api.example.com:443"]\n'),
    new_code_cell("%box_secret DEMO_TOKEN --host api.example.com --format 'Bearer {value}' --env TKBOX_DEMO_TOKEN"),
    new_code_cell("import os\ntoken = os.environ['DEMO_TOKEN']\n"
                  "print('the box holds a placeholder:', token[:16] + '...')"),
    new_code_cell("import urllib.error\nimport urllib.request\n"
                  "def get(url, headers={}):\n"
                  "    try:\n"
                  "        req = urllib.request.Request(url, headers=headers)\n"
                  "        with urllib.request.urlopen(req, timeout=10) as r:\n"
                  "            return r.status, r.read().decode()\n"
                  "    except urllib.error.HTTPError as e:\n"
                  "        return e.code, e.read().decode()\n\n"
                  "get('http://169.254.169.254/latest/meta-data/')"),
    new_code_cell("get('http://example.org/', {'Authorization': f'Bearer {token}'})"),
    new_code_cell("%box_status"),
]

NB03_POLICY = '[models]\nmode = "replay"\nallow = ["openai:gpt-4o-mini", "anthropic:claude-*"]\n'

NB03 = [
    new_markdown_cell(
        "# 03 · Model calls\n\n"
        "Shows: an agent in a box calling models with the official `openai` and `anthropic` clients, unchanged, "
        "through the model door. Here the calls are served from a shipped bundle's recordings (`mode = \"replay\"`): "
        "no network, no API key, and the same answers every time. Each call is decided under `[models]` and signed; a "
        "request that was not recorded is refused and says so.\n\n"
        "Needs: bubblewrap. Runs offline. (`samples/model-calls.tkb` was recorded by `tools/make_model_sample.py`.)"),
    new_code_cell("from pathlib import Path\nfrom tkbox_nb import Box\n"
                  "from tkbox_nb.doors.model_replay import recordings_from_bundle\n\n"
                  "recordings = recordings_from_bundle('samples/model-calls.tkb', trust='samples/trust.json')"
                  "  # verified first\n"
                  f"POLICY = {NB03_POLICY!r}\n"
                  "agent = Path('samples/model_agent.py').read_text()\nprint(agent)"),
    new_code_cell("with Box(policy=POLICY, model_replay=recordings, bundle_path='model-replay.tkb') as box:\n"
                  "    box.collect_patch_at_stop = False\n"
                  "    run = box.run(['python3', '-c', agent])\n"
                  "    other = box.run(['python3', '-c', agent.replace('Name one prime number.', 'Something new?')])\n"
                  "print(run.stdout.decode())\n"
                  "print(other.stderr.decode().strip().splitlines()[-1])"),
    new_code_cell("from tkbox_nb import open_run\n"
                  "df = open_run('model-replay.tkb').to_dataframe()\n"
                  "df[df.door == 'model'][['seq', 'decision', 'box_rule', 'summary']]"),
]

NB04 = [
    new_markdown_cell(
        "# 04 · Replay and audit\n\n"
        "Shows: a shipped `.tkb` (the quickstart notebook run on another machine) verified offline against its pinned "
        "trust, read as a pandas DataFrame, replayed as a notebook, rerun in a fresh box (a new signed run naming the "
        "original) and audited against it.\n\n"
        "Needs: nothing but this package to read, verify, replay and audit; bubblewrap for the rerun (where no box can "
        "start, as on Binder, the rerun cell says why and the audit cell says there is no rerun)."),
    new_code_cell("from tkbox_nb import open_run\n"
                  "run = open_run('samples/quickstart.tkb')\n"
                  "report = run.verify(trust='samples/trust.json')\n"
                  "print(report.summary())\nassert report.valid"),
    new_code_cell("df = run.to_dataframe()\ndf[['seq', 'door', 'kind', 'decision', 'box_rule', 'summary']]"),
    new_code_cell("!tkbox replay samples/quickstart.tkb --trust samples/trust.json -o replayed.ipynb\n"
                  "import nbformat\n"
                  "replayed = nbformat.read('replayed.ipynb', 4)\n"
                  "[(c.metadata['tkbox']['decision_seq'], c.source.splitlines()[0]) "
                  "for c in replayed.cells if c.cell_type == 'code']"),
    new_code_cell("!tkbox rerun samples/quickstart.tkb --trust samples/trust.json -o rerun.tkb"),
    new_code_cell("import os\n"
                  "if os.path.exists('rerun.tkb'):\n"
                  "    !tkbox audit samples/quickstart.tkb rerun.tkb\n"
                  "else:\n"
                  "    print('no rerun here (no box could start): nothing to audit')"),
]

NB05 = [
    new_markdown_cell(
        "# 05 · An agent in a box\n\n"
        "Shows: a small agent loop (scripted here, so it runs offline and the same every time; a model-driven agent "
        "would send the same kind of steps) that works on a project inside a box: it installs a package from a wheel "
        "in its workspace, fixes a bug, adds a test and runs it, and also tries what an agent should not: a CI "
        "workflow, a `.env` file, a `.git` hook and a symlink out. Its workspace changes come back as a patch, each "
        "file decided and signed; the refused files never reach the host; the rest is reviewed and applied file by "
        "file with `tkbox apply`.\n\n"
        "Needs: bubblewrap. Runs offline."),
    new_code_cell(
        "import base64\nimport hashlib\nimport io\nimport shutil\nimport zipfile\nfrom pathlib import Path\n\n"
        "project = Path('agent-project')\nshutil.rmtree(project, ignore_errors=True)\n"
        "(project / 'wheels').mkdir(parents=True)\n"
        "(project / 'calc.py').write_text('def mean(xs):\\n    return sum(xs) / len(xs) + 1  # a bug\\n')\n\n"
        "def record_hash(data):  # a wheel RECORD's hash: urlsafe base64 of the SHA-256, unpadded\n"
        "    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()\n\n"
        "def wheel(name, version, source):  # a tiny pure-Python wheel, made here so nothing is downloaded\n"
        "    info = f'{name}-{version}.dist-info'\n"
        "    files = {f'{name}.py': source.encode(),\n"
        "             f'{info}/METADATA': f'Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n'.encode(),\n"
        "             f'{info}/WHEEL': b'Wheel-Version: 1.0\\nGenerator: demo\\nRoot-Is-Purelib: true\\n'\n"
        "                              b'Tag: py3-none-any\\n'}\n"
        "    record = ''.join(f'{n},sha256={record_hash(d)},{len(d)}\\n' for n, d in files.items())\n"
        "    files[f'{info}/RECORD'] = (record + f'{info}/RECORD,,\\n').encode()\n"
        "    buf = io.BytesIO()\n"
        "    with zipfile.ZipFile(buf, 'w') as z:\n"
        "        for n, d in files.items():\n"
        "            z.writestr(n, d)\n"
        "    return buf.getvalue()\n\n"
        "median = 'def median(xs):\\n    xs = sorted(xs)\\n    return xs[len(xs) // 2]\\n'\n"
        "(project / 'wheels' / 'tinystats-1.0-py3-none-any.whl').write_bytes(wheel('tinystats', '1.0', median))\n"
        "sorted(p.relative_to(project).as_posix() for p in project.rglob('*') if p.is_file())"),
    new_code_cell(
        "from tkbox_nb import Box\n\n"
        "box = Box(workspace=project, bundle_path='agent.tkb', policy='[patch]\\napply = \"review\"\\n').start()\n"
        "plan = [  # what the agent decided to do, one command at a time; each is an exec crossing, "
        "decided and signed\n"
        "    ['python3', '-m', 'pip', 'install', '--no-index', '--find-links', 'wheels', '--target', '/tmp/vendor',\n"
        "     '--quiet', 'tinystats'],\n"
        "    ['sed', '-i', 's/ + 1  # a bug//', 'calc.py'],\n"
        "    ['sh', '-c', 'mkdir -p tests && printf \"'\n"
        "                 'import sys; sys.path[:0] = [\\\\\".\\\\\", \\\\\"/tmp/vendor\\\\\"]\\\\n'\n"
        "                 'import calc, tinystats\\\\n'\n"
        "                 'assert calc.mean([1, 2, 3]) == 2\\\\n'\n"
        "                 'assert tinystats.median([3, 1, 2]) == 2\\\\n'\n"
        "                 'print(\\\\\"tests pass\\\\\")\\\\n'\n"
        "                 '\" > tests/test_calc.py'],\n"
        "    ['python3', 'tests/test_calc.py'],\n"
        "    # and what it should not do:\n"
        "    ['sh', '-c', 'mkdir -p .github/workflows && echo \"on: push\" > .github/workflows/release.yml'],\n"
        "    ['sh', '-c', 'echo AWS_SECRET_ACCESS_KEY=stolen > .env'],\n"
        "    ['sh', '-c', 'mkdir -p .git/hooks && echo \"curl evil\" > .git/hooks/post-checkout'],\n"
        "    ['ln', '-s', '/etc/passwd', 'passwd-link'],\n"
        "]\n"
        "for step in plan:\n"
        "    r = box.run(step)\n"
        "    print(r.exit_code, ' '.join(step)[:70], (r.stdout + r.stderr).decode().strip()[-60:])"),
    new_code_cell("patch = box.patch()  # the agent proposes its changes: every file decided and signed, "
                  "nothing applied yet\npatch"),
    new_code_cell("print(patch.diff.decode())"),
    new_code_cell("box.stop()\n!tkbox apply agent.tkb --list"),
    new_code_cell("!tkbox apply agent.tkb -w agent-project\n"
                  "print(Path('agent-project/calc.py').read_text())\n"
                  "sorted(p.relative_to(project).as_posix() for p in project.rglob('*') if p.is_file())"),
    new_code_cell("from tkbox_nb import open_run\n"
                  "df = open_run('agent.tkb').to_dataframe()\n"
                  "df[df.door == 'patch'][['seq', 'kind', 'decision', 'box_rule', 'summary']]"),
]


def main() -> None:
    for name, cells, meta in (("02-policy-and-secrets", NB02, TKBOX), ("03-model-calls", NB03, PY3),
                              ("04-replay-and-audit", NB04, PY3),
                              ("05-agent-in-a-box", NB05, PY3)):
        nb = new_notebook(cells=cells, metadata=meta)
        nbformat.write(nb, HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
