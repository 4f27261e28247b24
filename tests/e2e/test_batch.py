"""Batch reruns and audits on Dask (`tkbox rerun --many`), with real boxes, a real signer and a real LocalCluster of
worker processes: ten recorded runs, one of which depended on a workspace file its rerun does not have (so its audit
must differ); every result arrives exactly once, also when a worker is killed with SIGKILL mid-batch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import VENV_BIN, short_tmp, tamper_content

from tkbox_nb import Box, open_run
from tkbox_nb.backends.bwrap import BwrapBackend
from tkbox_nb.audit.batch import BatchResult, rerun_path, run_batch
from tkbox_nb.box.notebook_box import HostMagics, NotebookBox
from tkbox_nb.bundle.verify import verify_bundle

pytestmark = pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1])

N = 10
ALTERED = 6  # the run whose cell read a file of its workspace: its rerun starts without it
COMMANDS = 3  # an agent's run: commands and a cell interleaved, through the Box API
READS_DATA = "import os\nprint('data:', open('data.txt').read() if os.path.exists('data.txt') else 'none')"


def record(out: Path, cells: list[str], workspace: Path | None = None) -> Path:
    nb = NotebookBox(bundle_dir=out.parent / f"{out.stem}-bundles", workspace=workspace)
    HostMagics(nb, lambda prompt: "").run("box_policy", "", "[exec]\ncells = true\n")
    for code in cells:
        nb.ensure_box().execute(code)
    nb.stop("done").replace(out)
    shutil.rmtree(out.parent / f"{out.stem}-bundles", ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def originals(signer, tmp_path_factory):
    d = tmp_path_factory.mktemp("originals")
    ws = d / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("version 1")
    runs = []
    for i in range(N):
        if i == COMMANDS:
            with Box(policy="[exec]\ncells = true\n", bundle_path=d / f"run{i:02d}.tkb") as box:
                box.run(["python3", "-c", f"print({i} * {i})"])
                box.execute(f"print('n squared', {i * i})")
                box.run(["sh", "-c", "echo done >&2; exit 2"])
            runs.append(d / f"run{i:02d}.tkb")
            continue
        cells = [f"n = {i}", "print('n squared', n * n)"]
        if i == ALTERED:
            cells.append(READS_DATA)
        runs.append(record(d / f"run{i:02d}.tkb", cells, workspace=ws if i == ALTERED else None))
    assert "data: version 1" in json.dumps(open_run(runs[ALTERED]).to_notebook().cells[-1].outputs)
    return runs


@pytest.fixture
def worker_tmp(monkeypatch):
    """TMPDIR of the worker processes (they inherit it): whatever a task leaves behind, even a killed one, is in
    here, and so is every box's host-side directory, so the test can tell that nothing is left running."""
    d = short_tmp("tkbt-")
    monkeypatch.setenv("TMPDIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def still_running(marker: Path) -> list[str]:
    """Processes whose command line names `marker` (a box's bwrap names its directory under TMPDIR)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                continue
            if str(marker) in cmd:
                found.append(f"{p.name}: {cmd[:120]}")
    return found


def check_results(results: list[BatchResult], originals: list[Path], out_dir: Path) -> None:
    assert [r.bundle for r in results] == [str(p) for p in originals]  # each once, in the order given
    statuses = [r.status for r in results]
    expected = ["different" if i == ALTERED else "equivalent" for i in range(N)]
    assert statuses == expected, [(i, r.status, r.reason) for i, r in enumerate(results) if r.status != expected[i]]
    kinds = [(c.args["kind"], (c.result or {}).get("exit_code")) for c in open_run(results[COMMANDS].new_bundle)
             .crossings() if c.door == "exec"]
    assert kinds == [("command", 0), ("cell", None), ("command", 2)]  # the command run was rerun, in its order
    bad = results[ALTERED]
    # the rerun started from no workspace, said first, and the cell that read it is the one that differs
    assert [d["what"] for d in bad.details] == ["workspace", "cell outputs #3"] and bad.differences == 2
    assert bad.details[0]["a"].startswith("tree2:sha256:") and bad.details[0]["b"].startswith("none")
    assert "version 1" in bad.details[1]["a"] and "none" in bad.details[1]["b"]
    written = sorted(out_dir.iterdir())
    assert written == sorted(rerun_path(p, out_dir) for p in originals)  # one file per bundle, no temporary left
    for r, p in zip(results, originals):
        assert r.new_bundle == str(rerun_path(p, out_dir))
        rerun = open_run(r.new_bundle)
        assert rerun.run_id != open_run(p).run_id
        assert rerun.box.get("rerun_of") == open_run(p).run_id and "replay_of" not in rerun.box


def test_ten_bundles_on_two_workers_each_result_once_one_different(originals, worker_tmp, tmp_path):
    out_dir = tmp_path / "reruns"
    r = subprocess.run([str(VENV_BIN / "tkbox"), "rerun", "--many", *map(str, originals), "--workers", "2",
                        "--out-dir", str(out_dir), "--html", str(tmp_path / "report.html"), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]  # one different, none failed
    assert "Traceback" not in r.stderr
    progress = [line for line in r.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == N and progress[-1].startswith(f"[{N}/{N}]")
    assert sorted(line.split()[2] for line in progress) == sorted(map(str, originals))  # as they arrived, each once
    report = json.loads(r.stdout)
    assert report["exit_code"] == 1
    results = [BatchResult(**row) for row in report["results"]]
    check_results(results, originals, out_dir)
    assert len({row["worker"] for row in report["results"]}) == 2  # both workers took bundles
    for row in report["results"]:
        assert verify_bundle(row["new_bundle"]).valid
    page = (tmp_path / "report.html").read_text()
    assert "<script" not in page and "9 equivalent, 1 different, 0 failed" in page and "data: version 1" in page
    assert still_running(worker_tmp) == []


def children(pid: int, name: str) -> list[int]:
    """The live child processes of `pid` called `name`."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if comm == name and rest[0] != "Z" and int(rest[1]) == pid:
                found.append(int(p.name))
    return found


def holders(signer) -> set[int]:
    """The pids of the processes holding an open run of `signer` (each open run's spool names its holder)."""
    pids = set()
    for handle in signer.runs_dir.glob("*/handle.json"):
        try:
            pids.add(json.loads(handle.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            continue  # being written or removed
    return pids


def test_a_worker_killed_mid_batch_loses_no_result_and_none_twice(originals, signer, worker_tmp, tmp_path):
    from distributed import Client, LocalCluster
    out_dir = tmp_path / "reruns"
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                           memory_limit=0)
    client = Client(cluster, set_as_default=False)
    killed: dict = {}

    def kill_a_busy_worker(r, done, total):
        arrived.append(r.bundle)
        if killed:
            return
        for _ in range(400):  # the first result is in: kill a worker while its box is running a rerun
            pids = client.run(os.getpid)
            # a bwrap child alone is not enough: choosing the backend runs a short bwrap probe before any run is open
            boxed = {w: pid for w, pid in pids.items() if children(pid, "bwrap") and pid in holders(signer)}
            if boxed:
                break
            time.sleep(0.05)
        assert boxed, "no worker was running a box"
        worker, pid = next(iter(boxed.items()))
        keys = client.processing()[worker]
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, keys=list(keys), done=done)

    arrived: list[str] = []
    try:
        results = run_batch([str(p) for p in originals], out_dir, client=client, progress=kill_a_busy_worker)
    finally:
        client.close()
        cluster.close()
    assert killed and killed["done"] == 1
    assert sorted(arrived) == sorted(map(str, originals))  # every result arrived, exactly once
    check_results(results, originals, out_dir)
    # the task that was running on the killed worker ran again elsewhere: its result names another process
    retried = [r for r in results if any(k.endswith(_key_tail(r.bundle)) for k in killed["keys"])]
    assert retried and all(r.worker.rsplit(":", 1)[1] != str(killed["pid"]) for r in retried)
    assert still_running(worker_tmp) == []  # the killed worker's box and kernel died with it
    assert list(worker_tmp.glob("tkbox-batch-*")) == []  # its scratch directory was swept by a later task
    # its run was left open mid-rerun; a later box start closes it and writes its bundle (where orphans go). Under
    # load the batch's last box may start while the killed worker is not yet reaped (a zombie still counts as alive,
    # so its run is rightly left alone): the next box start's recovery step, run here, closes it then
    if not any(f"(pid {killed['pid']})" in (open_run(b).box.get("end_reason") or "")
               for b in (signer.home / "bundles").glob("*.tkb")):
        from tkbox_nb.signing.recovery import recover_orphans
        recover_orphans(signer)
    recovered = [open_run(b) for b in (signer.home / "bundles").glob("*.tkb")]
    assert any(f"(pid {killed['pid']})" in (run.box.get("end_reason") or "") for run in recovered)


def _key_tail(bundle: str) -> str:
    import hashlib
    return hashlib.sha256(str(Path(bundle).resolve()).encode()).hexdigest()[:16]


def test_bad_input_is_a_failed_row_or_one_line(originals, worker_tmp, tmp_path):
    tampered = tamper_content(originals[0], tmp_path / "tampered.tkb")
    missing = tmp_path / "missing.tkb"
    r = subprocess.run([str(VENV_BIN / "tkbox"), "rerun", "--many", str(missing), str(tampered), "--workers", "1",
                        "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(str(tmp_path))}
    assert "failed" in rows[str(missing)] and "No such file" in rows[str(missing)]
    assert "failed" in rows[str(tampered)] and "does not verify" in rows[str(tampered)]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    for args, says in ((["--scheduler", "tcp://127.0.0.1:9"], "cannot reach the Dask scheduler"),
                       (["--scheduler", "nonsense://x"], "give tcp://HOST:PORT"),
                       (["--scheduler", "tcp://127.0.0.1"], "give tcp://HOST:PORT"),
                       (["--scheduler", "tcp://127.0.0.1:9", "--workers", "2"], "--workers sets the size"),
                       (["-o", "x.tkb"], "with --many each rerun goes to --out-dir"),
                       (["--env", "HOME"], "go with one rerun (-o), not --many"),
                       (["--policy", str(tmp_path / "nopolicy.toml")], "cannot read the policy")):
        r = subprocess.run([str(VENV_BIN / "tkbox"), "rerun", "--many", str(originals[0]), *args],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([str(VENV_BIN / "tkbox"), "rerun", str(originals[0]), "--workers", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--workers goes with --many" in r.stderr


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_running_scheduler_and_its_worker_take_the_batch(originals, worker_tmp, tmp_path):
    """`--scheduler tcp://HOST:PORT`: a scheduler and a worker started with Dask's own CLI on loopback, as on a host
    of a lab's cluster; the client ships each bundle to the worker and writes what comes back."""
    port = _free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [subprocess.Popen([str(VENV_BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=open(logs / "scheduler", "wb"),
                              start_new_session=True)]
    try:
        procs.append(subprocess.Popen([str(VENV_BIN / "dask"), "worker", f"tcp://127.0.0.1:{port}", "--nthreads",
                                       "1", "--no-dashboard", "--host", "127.0.0.1", "--memory-limit", "0"],
                                      stdout=subprocess.DEVNULL, stderr=open(logs / "worker", "wb"),
                                      start_new_session=True))
        from distributed import Client
        with Client(f"tcp://127.0.0.1:{port}", timeout="60s", set_as_default=False) as c:
            c.wait_for_workers(1, timeout=60)
        bundles = [str(originals[0]), str(originals[ALTERED])]
        r = subprocess.run([str(VENV_BIN / "tkbox"), "rerun", "--many", *bundles, "--scheduler",
                            f"tcp://127.0.0.1:{port}", "--out-dir", str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr[-2000:]
        rows = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines() if line.split() and
                line.split()[0] in bundles}
        assert rows == {bundles[0]: "equivalent", bundles[1]: "different"}, r.stdout
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
            sorted(rerun_path(b, tmp_path / "out").name for b in bundles)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert still_running(worker_tmp) == []
