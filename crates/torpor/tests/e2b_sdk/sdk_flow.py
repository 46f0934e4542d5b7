"""The official, unmodified e2b Python SDK against torpor.

Environment: E2B_API_KEY (a torpor tenant token), E2B_API_URL, E2B_SANDBOX_URL (torpor's
listener), OTHER_KEY (another tenant's token). Prints one line per step; exits non-zero on the
first failure.
"""
import os
import sys
import threading
import time

import e2b
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException
from e2b.sandbox.commands.command_handle import CommandExitException


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


print("e2b sdk", e2b.__file__, flush=True)

step("create")
RUN = str(os.getpid())
sbx = Sandbox.create(metadata={"suite": "e2b-test", "run": RUN}, timeout=600)
expect(sbx.sandbox_id, "sandbox id")
info = sbx.get_info()
expect(info.state.value == "running", f"state {info.state}")
expect(info.metadata.get("suite") == "e2b-test", f"metadata {info.metadata}")

step("run plain")
r = sbx.commands.run("echo hello; echo oops >&2; exit 0")
expect(r.exit_code == 0, f"exit {r.exit_code}")
expect(r.stdout == "hello\n", f"stdout {r.stdout!r}")
expect(r.stderr == "oops\n", f"stderr {r.stderr!r}")

step("run non-zero exit")
try:
    sbx.commands.run("echo partial; exit 3")
    raise AssertionError("no CommandExitException")
except CommandExitException as e:
    expect(e.exit_code == 3, f"exit {e.exit_code}")
    expect(e.stdout == "partial\n", f"stdout {e.stdout!r}")

step("run streaming")
chunks = []
r = sbx.commands.run(
    "for i in 1 2 3; do echo line$i; sleep 0.2; done",
    on_stdout=lambda s: chunks.append(s),
)
expect("".join(chunks) == "line1\nline2\nline3\n", f"chunks {chunks!r}")
expect(len(chunks) >= 2, f"output arrived in one piece: {chunks!r}")

step("output arrives while the command runs, not at its end")
# The command waits for a file the client writes only once it has seen the first line: the
# first line must come while the command still runs.
seen = threading.Event()
got = []
result = {}
def first_line(s):
    got.append(s)
    seen.set()
h = sbx.commands.run(
    "echo first; while [ ! -f /tmp/go ]; do sleep 0.05; done; echo second",
    background=True,
)
reader = threading.Thread(
    target=lambda: result.setdefault("r", h.wait(on_stdout=first_line)), daemon=True
)
reader.start()
expect(seen.wait(20), f"no output while the command ran: {got!r}")
sbx.files.write("/tmp/go", "")
reader.join(20)
expect(result.get("r") is not None, "the command did not end")
expect(result["r"].stdout == "first\nsecond\n", f"stdout {result['r'].stdout!r}")

step("more output than one reply carries, on both streams")
r = sbx.commands.run(
    "head -c 3000000 /dev/zero | tr '\\0' o; head -c 2500000 /dev/zero | tr '\\0' e >&2"
)
expect(r.stdout == "o" * 3000000, f"stdout of {len(r.stdout)} bytes")
expect(r.stderr == "e" * 2500000, f"stderr of {len(r.stderr)} bytes")

step("env and cwd")
r = sbx.commands.run("echo $GREETING; pwd", envs={"GREETING": "hi there"}, cwd="/tmp")
expect(r.stdout == "hi there\n/tmp\n", f"stdout {r.stdout!r}")

step("background + kill")
h = sbx.commands.run("sleep 600", background=True)
expect(h.pid > 0, "pid")
pids = [p.pid for p in sbx.commands.list()]
expect(h.pid in pids, f"{h.pid} not in {pids}")
expect(h.kill() is True, "kill")
try:
    h.wait()
    raise AssertionError("a killed command exited cleanly")
except CommandExitException as e:
    expect(e.exit_code != 0, "exit code")
pids = [p.pid for p in sbx.commands.list()]
expect(h.pid not in pids, f"{h.pid} still listed")

step("stdin")
h = sbx.commands.run("cat", background=True, stdin=True)
sbx.commands.send_stdin(h.pid, "piped\n")
sbx.commands.close_stdin(h.pid)
r = h.wait()
expect(r.stdout == "piped\n", f"stdout {r.stdout!r}")

step("files write/read/list/remove")
sbx.files.write("/home/user/notes/a.txt", "alpha")
sbx.files.write("rel.txt", b"\x00\x01binary")
expect(sbx.files.read("/home/user/notes/a.txt") == "alpha", "read a")
expect(bytes(sbx.files.read("/home/user/rel.txt", format="bytes")) == b"\x00\x01binary", "read rel")
names = sorted(e.name for e in sbx.files.list("/home/user/notes"))
expect(names == ["a.txt"], f"list {names}")
expect(sbx.files.exists("/home/user/notes/a.txt"), "exists")
expect(sbx.files.make_dir("/home/user/newdir") is True, "make_dir")
expect(sbx.files.make_dir("/home/user/newdir") is False, "make_dir twice")
sbx.files.rename("/home/user/notes/a.txt", "/home/user/notes/b.txt")
expect(sbx.files.read("/home/user/notes/b.txt") == "alpha", "renamed")
sbx.files.remove("/home/user/notes/b.txt")
expect(not sbx.files.exists("/home/user/notes/b.txt"), "removed")
try:
    sbx.files.read("/home/user/none.txt")
    raise AssertionError("read of a missing file")
except NotFoundException:
    pass
r = sbx.commands.run("cat /home/user/rel.txt | od -An -c | tr -s ' '")
expect("b i n a r y" in r.stdout, f"file seen by commands: {r.stdout!r}")

step("watch")
w = sbx.files.watch_dir("/home/user/notes")
sbx.files.write("/home/user/notes/w.txt", "x")
time.sleep(0.3)
evs = w.get_new_events()
expect(any(e.name == "w.txt" for e in evs), f"events {evs}")
w.stop()

step("list with metadata filter")
found = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b-test", "run": RUN})).next_items()
expect([s.sandbox_id for s in found] == [sbx.sandbox_id], f"list {found}")
none = Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items()
expect(none == [], f"filtered list {none}")

step("pause with a live process")
# A process holding state in memory: it counts the lines it read.
h = sbx.commands.run(
    "python3 -u -c 'import sys\nn=0\nwhile True:\n  l=sys.stdin.readline()\n  if not l: break\n  n+=1\n  print(n, flush=True)\n'",
    background=True,
    stdin=True,
)
pid = h.pid
sbx.commands.send_stdin(pid, "a\n")
sbx.files.write("/home/user/state.txt", "kept")
time.sleep(0.5)
expect(sbx.pause() is True, "pause")
expect(Sandbox.get_info(sbx.sandbox_id).state.value == "paused", "paused")
# The SDK answers False when the API says 409 (already paused).
expect(sbx.pause() is False, "second pause")
paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata={"suite": "e2b-test", "run": RUN})).next_items()
expect([s.sandbox_id for s in paused] == [sbx.sandbox_id], f"paused list {paused}")

step("connect")
sbx2 = Sandbox.connect(sbx.sandbox_id)
expect(sbx2.get_info().state.value == "running", "running after connect")
expect(sbx2.files.read("/home/user/state.txt") == "kept", "file kept")
pids = [p.pid for p in sbx2.commands.list()]
expect(pid in pids, f"process {pid} survived: {pids}")
h2 = sbx2.commands.connect(pid)
sbx2.commands.send_stdin(pid, "b\n")
sbx2.commands.close_stdin(pid)
r = h2.wait()
expect(r.stdout == "2\n", f"counter after wake: {r.stdout!r} (memory kept)")

step("errors")
try:
    Sandbox.connect("sbxunknown000000")
    raise AssertionError("connect to an unknown id")
except NotFoundException:
    pass
try:
    Sandbox.create(api_key="tpr_nobody_wrongwrongwrong")
    raise AssertionError("bad key accepted")
except AuthenticationException:
    pass
other = os.environ.get("OTHER_KEY")
if other:
    try:
        Sandbox.connect(sbx.sandbox_id, api_key=other)
        raise AssertionError("another tenant connected")
    except NotFoundException:
        pass

step("kill")
expect(sbx2.kill() is True or sbx2.kill() is None, "kill")
expect(Sandbox.kill(sbx.sandbox_id) is False, "kill twice answers False")
print("ALL OK", flush=True)
