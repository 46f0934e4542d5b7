"""E2B processes through the supervisor-shell fallback (a sandbox whose agent predates `Spawn`,
as one restored from an older torpor's snapshot), with the official, unmodified e2b Python SDK:
commands.run plain and in the background, stdin, list, kill; a terminal is refused.

The template named by TEMPLATE sets TORPOR_AGENT_TEST_WITHOUT_SPAWN=1, so its agent answers
`Spawn` as an older agent does. Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL, TEMPLATE.
"""
import os
import threading

from e2b import Sandbox
from e2b.sandbox.commands.command_handle import PtySize


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


sbx = Sandbox.create(template=os.environ["TEMPLATE"], timeout=600)

step("commands.run through the supervisor shell")
r = sbx.commands.run("echo out-$((6*7)); echo err >&2; pwd; tr '\\0\\n' '  ' < /proc/$PPID/cmdline")
expect(r.exit_code == 0, f"exit {r.exit_code}")
lines = r.stdout.splitlines()
expect(lines[0] == "out-42", r.stdout)
expect(r.stderr == "err\n", repr(r.stderr))
expect(lines[1] == "/home/user", r.stdout)
# The command's parent is the supervisor shell (with Spawn it would be the agent, pid 1).
expect("/run/e2b/proc/k" in lines[2], f"parent: {lines[2]!r}")

step("exit code and cwd")
try:
    sbx.commands.run("exit 3", cwd="/tmp")
    raise AssertionError("exit 3 did not raise")
except AssertionError:
    raise
except Exception as e:  # CommandExitException
    expect(getattr(e, "exit_code", None) == 3, f"{type(e).__name__}: {e}")
expect(sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n", "cwd")

step("background with stdin, streamed output, list")
got = []
seen = threading.Event()


def on_stdout(s):
    got.append(s)
    if "ping" in "".join(got):
        seen.set()


c = sbx.commands.run("cat", background=True, stdin=True)
reader = threading.Thread(target=lambda: c.wait(on_stdout=on_stdout), daemon=True)
reader.start()
expect(any(p.pid == c.pid for p in sbx.commands.list()), "the background process is listed")
sbx.commands.send_stdin(c.pid, "ping\n")
expect(seen.wait(30), f"cat echoed the input: {got!r}")
sbx.commands.close_stdin(c.pid)
reader.join(timeout=30)
expect(not reader.is_alive(), "cat ended after close_stdin")

step("kill a background process")
s = sbx.commands.run("sleep 600", background=True)
expect(any(p.pid == s.pid for p in sbx.commands.list()), "sleep is listed")
expect(sbx.commands.kill(s.pid), "kill answers True")
try:
    s.wait()
    raise AssertionError("a killed process did not raise")
except AssertionError:
    raise
except Exception as e:  # CommandExitException: signal: killed
    expect("killed" in str(e).lower() or getattr(e, "exit_code", 0) != 0, str(e))
expect(not any(p.pid == s.pid for p in sbx.commands.list()), "gone after kill")

step("terminals are refused")
try:
    sbx.pty.create(size=PtySize(rows=24, cols=80), timeout=0)
    raise AssertionError("pty.create through the fallback")
except AssertionError:
    raise
except Exception as e:
    expect("predates terminals" in str(e), f"{type(e).__name__}: {e}")

sbx.kill()
print("ALL OK", flush=True)
