"""Terminals and streamed input through the official, unmodified e2b Python SDK: pty.create,
send_stdin, resize, stream_input, kill; commands.stream_input to a process's stdin, each input
written while the stream is still open.

Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (torpor's listener).
"""
import threading
import time

from e2b import Sandbox
from e2b.sandbox.commands.command_handle import PtySize


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


sbx = Sandbox.create(timeout=600)

step("pty.create")
out = bytearray()
lock = threading.Lock()


def on_data(d):
    with lock:
        out.extend(d)


h = sbx.pty.create(size=PtySize(rows=24, cols=80), timeout=0)
expect(h.pid > 0, "pid")
t = threading.Thread(target=lambda: h.wait(on_pty=on_data), daemon=True)
t.start()


def wait_for(marker, what):
    deadline = time.time() + 30
    while True:
        with lock:
            if marker in out:
                return
        expect(time.time() < deadline, f"{what}: {bytes(out)[-400:]!r}")
        time.sleep(0.05)


step("send_stdin to the terminal")
sbx.pty.send_stdin(h.pid, b"tty; echo mark-$((6*7))\n")
wait_for(b"mark-42", "echoed command output")
with lock:
    expect(b"/dev/pts/" in out, f"a real terminal: {bytes(out)[-400:]!r}")

step("resize")
sbx.pty.resize(h.pid, PtySize(rows=33, cols=101))
sbx.pty.send_stdin(h.pid, b"echo size-$(stty size | tr ' ' x)\n")
wait_for(b"size-33x101", "stty size after resize")

step("stream_input to the terminal")
sbx.pty.stream_input(h.pid, ["echo stre", "amed-$((2+3))\n"])
wait_for(b"streamed-5", "streamed input")

step("listed, then kill")
expect(any(p.pid == h.pid for p in sbx.commands.list()), "the terminal is listed")
expect(sbx.pty.kill(h.pid), "kill")
t.join(timeout=30)
expect(not t.is_alive(), "the terminal's stream ended")
expect(not any(p.pid == h.pid for p in sbx.commands.list()), "gone after kill")

step("commands.stream_input to stdin")
c = sbx.commands.run("cat", background=True, stdin=True)
sbx.commands.stream_input(c.pid, ["one ", "two\n"])
sbx.commands.close_stdin(c.pid)
r = c.wait()
expect(r.stdout == "one two\n", f"cat got {r.stdout!r}")

step("commands.stream_input writes each input as it arrives")
# The generator yields a line, then waits until `cat` has echoed it back before yielding the
# next: this completes only if each input reaches the process while the stream is still open.
echoed = bytearray()
seen = threading.Condition()


def on_stdout(s):
    with seen:
        echoed.extend(s.encode())
        seen.notify_all()


c = sbx.commands.run("cat", background=True, stdin=True)
reader = threading.Thread(target=lambda: c.wait(on_stdout=on_stdout), daemon=True)
reader.start()
not_echoed = []


def one_at_a_time():
    for i in range(3):
        line = f"line-{i}\n"
        yield line
        with seen:
            if not seen.wait_for(lambda: line.encode() in echoed, timeout=15):
                # End the stream instead of hanging: the assertion below reports it.
                not_echoed.append(line)
                return


sbx.commands.stream_input(c.pid, one_at_a_time(), timeout=60)
expect(
    not not_echoed,
    f"{not_echoed[:1]!r} was not written while the stream was open (got {bytes(echoed)!r})",
)
sbx.commands.close_stdin(c.pid)
reader.join(timeout=30)
expect(not reader.is_alive(), "cat ended after close_stdin")
expect(bytes(echoed) == b"line-0\nline-1\nline-2\n", f"cat echoed {bytes(echoed)!r}")

step("errors")
try:
    sbx.pty.resize(999999, PtySize(rows=1, cols=1))
    raise AssertionError("resize of an unknown pid")
except AssertionError:
    raise
except Exception as e:  # NotFoundException
    expect("not found" in str(e).lower(), str(e))

step("an error ends stream_input at once")
# An error ends a stream at once, while the client is still sending: here an unknown pid,
# answered after `start` although the generator would go on for a minute.
sent = []
stop = threading.Event()


def slow_forever():
    for i in range(600):
        if stop.is_set():
            return
        sent.append(i)
        yield f"x{i}\n"
        stop.wait(0.1)


try:
    sbx.commands.stream_input(999999, slow_forever(), timeout=120)
    raise AssertionError("stream_input to an unknown pid")
except AssertionError:
    raise
except Exception as e:  # NotFoundException
    expect("not found" in str(e).lower(), f"{type(e).__name__}: {e}")
finally:
    # The SDK's transport may still be pulling from the generator: let it end.
    stop.set()
expect(len(sent) < 600, f"the error came only after the client finished ({len(sent)} sent)")
time.sleep(0.2)

sbx.kill()
print("ALL OK", flush=True)
