"""E2B's `base` template as E2B code relies on it (issue 19), through the official, unmodified
e2b Python SDK: commands run as `user` (uid 1000, home /home/user), files written through the
SDK belong to `user`, `sudo` works for `user` (and for nobody else), `python` is Python 3, and
all of it survives pause and connect.

Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (torpor's listener).
"""
import time

from e2b import Sandbox


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def owner(sbx, path):
    r = sbx.commands.run(
        f"python -c 'import os; s = os.stat(\"{path}\"); print(s.st_uid, s.st_gid)'"
    )
    return r.stdout.strip()


sbx = Sandbox.create(timeout=600)
expect(sbx.get_info().template_id == "base", f"default template {sbx.get_info()}")

step("commands run as user in their home")
r = sbx.commands.run('whoami; id -u; id -g; echo "$HOME"; pwd')
expect(
    r.stdout.split() == ["user", "1000", "1000", "/home/user", "/home/user"],
    f"identity {r.stdout!r}",
)
r = sbx.commands.run("whoami; pwd", user="root")
expect(r.stdout.split() == ["root", "/root"], f"as root {r.stdout!r}")
try:
    sbx.commands.run("touch /etc/not-yours")
    raise AssertionError("user wrote /etc without sudo")
except Exception as e:  # CommandExitException
    expect("Permission denied" in str(e) or "exit" in str(e).lower(), f"refusal {e}")

step("python is Python 3")
r = sbx.commands.run("python --version; python -c 'import sys; print(sys.version_info[0])'")
expect(r.stdout.split()[0] == "Python" and r.stdout.split()[-1] == "3", f"python {r.stdout!r}")

step("sudo works for user")
r = sbx.commands.run("sudo whoami; sudo id -u; sudo -u user id -u")
expect(r.stdout.split() == ["root", "0", "1000"], f"sudo {r.stdout!r}")
r = sbx.commands.run("sudo sh -c 'echo made > /etc/by-sudo' && cat /etc/by-sudo")
expect(r.stdout.strip() == "made", f"sudo write {r.stdout!r}")
r = sbx.commands.run("echo piped | sudo tee /etc/piped > /dev/null; cat /etc/piped")
expect(r.stdout.strip() == "piped", f"sudo stdin {r.stdout!r}")
try:
    sbx.commands.run("sudo sh -c 'exit 7'")
    raise AssertionError("sudo lost the exit status")
except Exception as e:
    expect(getattr(e, "exit_code", None) == 7, f"exit status {e!r}")

step("sudo refuses anyone but user and root")
try:
    sbx.commands.run("sudo -u nobody sudo true")
    raise AssertionError("nobody got root through sudo")
except Exception as e:
    expect("not in the sudoers file" in str(e), f"nobody refused {e}")

step("killing a sudo command kills what it runs as root")
h = sbx.commands.run("sudo sleep 321", background=True)
deadline = time.time() + 20
while "sleep 321" not in sbx.commands.run("ps -eo args || true", user="root").stdout:
    expect(time.time() < deadline, "the root sleep never started")
    time.sleep(0.2)
sbx.commands.kill(h.pid)
while "sleep 321" in sbx.commands.run("ps -eo args || true", user="root").stdout:
    expect(time.time() < deadline, "the root sleep outlived its sudo")
    time.sleep(0.2)

step("files written through the SDK belong to user")
sbx.files.write("/home/user/a.txt", "x")
expect(owner(sbx, "/home/user/a.txt") == "1000 1000", "upload owner")
sbx.files.write("/tmp/made/deep/f.txt", "x")
for p in ["/tmp/made", "/tmp/made/deep", "/tmp/made/deep/f.txt"]:
    expect(owner(sbx, p) == "1000 1000", f"owner of {p}: {owner(sbx, p)}")
sbx.files.make_dir("/home/user/newdir")
expect(owner(sbx, "/home/user/newdir") == "1000 1000", "make_dir owner")
sbx.files.write("/root/r.txt", "x", user="root")
expect(owner(sbx, "/root/r.txt") == "0 0", "a root write is root's")
r = sbx.commands.run("echo hi > /home/user/by-cmd.txt")
expect(owner(sbx, "/home/user/by-cmd.txt") == "1000 1000", "command output owner")

step("sbx.git: local operations run git as user")
sbx.git.init("/home/user/repo", initial_branch="main")
sbx.git.configure_user("Tester", "tester@example.com")
sbx.files.write("/home/user/repo/a.txt", "a")
st = sbx.git.status("/home/user/repo")
expect(any(f.name == "a.txt" for f in st.file_status), f"status {st}")
sbx.git.add("/home/user/repo")
sbx.git.commit("/home/user/repo", "first")
b = sbx.git.branches("/home/user/repo")
expect(b.current_branch == "main", f"branches {b}")
r = sbx.commands.run("git -C /home/user/repo log --format=%an:%s")
expect(r.stdout.strip() == "Tester:first", f"log {r.stdout!r}")
expect(owner(sbx, "/home/user/repo/.git") == "1000 1000", "the repository is user's")

step("user and sudo survive pause and connect")
sbx.pause()
sbx = Sandbox.connect(sbx.sandbox_id)
r = sbx.commands.run("whoami; sudo whoami; cat /etc/by-sudo")
expect(r.stdout.split() == ["user", "root", "made"], f"after connect {r.stdout!r}")

sbx.kill()
print("ALL OK")
