"""E2B's filesystem surface beyond the happy path (issue 19), through the official, unmodified
e2b Python SDK: entries' owner and group, files written through the SDK as envd writes them,
signed download and upload URLs (expiry, tampering), and directory watches (recursive,
folders made after the watch started, event order, renames, chmod, changes undone at once).

Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (torpor's listener).
"""
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import httpx
from e2b import FilesystemEventType, Sandbox
from e2b.sandbox.filesystem.filesystem import FileType


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def http_error(url, data=None, method="GET"):
    """(status, JSON body) of a request expected to fail."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=data, method=method))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    raise AssertionError(f"{method} {url} succeeded")


def with_query(url, **changes):
    parts = urllib.parse.urlsplit(url)
    q = dict(urllib.parse.parse_qsl(parts.query))
    q.update(changes)
    return urllib.parse.urlunsplit(
        parts._replace(query=urllib.parse.urlencode(q, quote_via=urllib.parse.quote))
    )


sbx = Sandbox.create(timeout=600, secure=True)

step("entries report their owner and group by name")
sbx.files.write("/home/user/mine.txt", "x")
i = sbx.files.get_info("/home/user/mine.txt")
expect((i.owner, i.group) == ("user", "user"), f"a user's file: {i}")
i = sbx.files.get_info("/etc/passwd")
expect((i.owner, i.group) == ("root", "root"), f"a root file: {i}")
sbx.files.write("/root/r.txt", "x", user="root")
i = sbx.files.get_info("/root/r.txt", user="root")
expect((i.owner, i.group) == ("root", "root"), f"a root write: {i}")
sbx.commands.run("sudo sh -c ': > /tmp/nob && chown 65534:65534 /tmp/nob && : > /tmp/num && chown 4242:4343 /tmp/num'")
owners = {e.name: (e.owner, e.group) for e in sbx.files.list("/tmp")}
expect(owners.get("nob") == ("nobody", "nogroup"), f"named from /etc/passwd: {owners}")
expect(owners.get("num") == ("4242", "4343"), f"an id without a name: {owners}")
home = {e.name: (e.owner, e.group) for e in sbx.files.list("/home/user")}
expect(home.get("mine.txt") == ("user", "user"), f"list: {home}")

step("files.write acts as envd: root writes, the file and the directories it makes are the user's")
# envd (packages/envd/internal/api/upload.go) writes as root and chowns to the caller, so a
# write as `user` into a root-owned directory succeeds there and is the user's.
sbx.files.write("/opt/by-sdk/deep/f.txt", "x")
for p in ["/opt/by-sdk", "/opt/by-sdk/deep", "/opt/by-sdk/deep/f.txt"]:
    i = sbx.files.get_info(p)
    expect((i.owner, i.group) == ("user", "user"), f"owner of {p}: {i}")
expect(sbx.files.get_info("/opt").owner == "root", "an existing directory keeps its owner")

step("signed download URL")
sbx.files.write("signed.txt", "signed content")
url = sbx.download_url("signed.txt")
expect("signature=v1_" in url, f"the SDK signed it: {url}")
with urllib.request.urlopen(url) as r:
    expect(r.status == 200 and r.read().decode() == "signed content", "signed download")
url = sbx.download_url("signed.txt", use_signature_expiration=120)
expect("signature_expiration=" in url, url)
with urllib.request.urlopen(url) as r:
    expect(r.read().decode() == "signed content", "signed download with an expiry")

step("an expired signature answers 401")
url = sbx.download_url("signed.txt", "user", use_signature_expiration=-120)
code, body = http_error(url)
expect(code == 401, f"expired: {code}")
expect(body == {"code": 401, "message": "signature is already expired"}, f"expired: {body}")

step("a signature for something else is refused")
good = sbx.download_url("signed.txt", use_signature_expiration=120)
for tampered in [
    with_query(good, path="mine.txt"),
    with_query(good, username="root"),
    with_query(good, signature_expiration=str(int(time.time()) + 9999)),
    with_query(good, signature="v1_" + "A" * 43),
]:
    code, body = http_error(tampered)
    expect((code, body["message"]) == (401, "invalid signature"), f"{tampered}: {code} {body}")
# A read signature does not upload.
code, body = http_error(good, data=b"x", method="POST")
expect(code == 401, f"a read signature used to write: {code} {body}")
# Another sandbox's signature does not reach this one's files.
other = Sandbox.create(timeout=300)
other.files.write("signed.txt", "the other one")
theirs = other.download_url("signed.txt", use_signature_expiration=120)
with urllib.request.urlopen(theirs) as r:
    expect(r.read().decode() == "the other one", "each signature reaches its own sandbox")
other.kill()

step("signed upload URL")
url = sbx.upload_url("uploaded/u.txt", use_signature_expiration=120)
r = httpx.post(url, files={"file": ("u.txt", b"uploaded bytes")})
expect(r.status_code == 200, f"signed upload: {r.status_code} {r.text}")
expect(sbx.files.read("uploaded/u.txt") == "uploaded bytes", "uploaded content")
expect(sbx.files.get_info("uploaded/u.txt").owner == "user", "a signed upload is the user's")
r = httpx.post(sbx.upload_url("up2.txt", use_signature_expiration=-5), files={"file": ("f", b"x")})
expect(r.status_code == 401, f"expired upload: {r.status_code}")
expect(not sbx.files.exists("up2.txt"), "nothing written by an expired upload")

step("recursive watch: folders made after the watch started, events in order")
sbx.files.make_dir("/home/user/w")
h = sbx.files.watch_dir("/home/user/w", recursive=True)
sbx.files.make_dir("/home/user/w/later")
time.sleep(0.5)
sbx.files.write("/home/user/w/later/inner.txt", "hello")
time.sleep(0.5)
sbx.commands.run("echo more >> /home/user/w/later/inner.txt")
time.sleep(0.5)
sbx.files.remove("/home/user/w/later/inner.txt")
deadline = time.time() + 10
events = []
while time.time() < deadline:
    events += [(e.type, e.name) for e in h.get_new_events()]
    if (FilesystemEventType.REMOVE, "later/inner.txt") in events:
        break
    time.sleep(0.3)
h.stop()
print("events:", events, flush=True)
want = [
    (FilesystemEventType.CREATE, "later"),
    (FilesystemEventType.CREATE, "later/inner.txt"),
    (FilesystemEventType.WRITE, "later/inner.txt"),
    (FilesystemEventType.REMOVE, "later/inner.txt"),
]
pos = [events.index(w) if w in events else -1 for w in want]
expect(-1 not in pos, f"missing events {[w for w, p in zip(want, pos) if p < 0]}: {events}")
expect(pos == sorted(pos), f"events out of order: {events}")

step("watches see every change as inotify reports it: renames, chmod, what is undone at once")
sbx.files.make_dir("/home/user/w2")
h = sbx.files.watch_dir("/home/user/w2")
sbx.commands.run("cd /home/user/w2 && touch a && chmod 600 a && mv a b && touch gone && rm gone")
deadline = time.time() + 10
events = []
while time.time() < deadline and (FilesystemEventType.REMOVE, "gone") not in events:
    events += [(e.type, e.name) for e in h.get_new_events()]
    time.sleep(0.3)
h.stop()
print("events:", events, flush=True)
want = [
    (FilesystemEventType.CREATE, "a"),
    (FilesystemEventType.CHMOD, "a"),
    (FilesystemEventType.RENAME, "a"),
    (FilesystemEventType.CREATE, "b"),
    (FilesystemEventType.CREATE, "gone"),
    (FilesystemEventType.REMOVE, "gone"),
]
pos = [events.index(w) if w in events else -1 for w in want]
expect(-1 not in pos, f"missing events {[w for w, p in zip(want, pos) if p < 0]}: {events}")
expect(pos == sorted(pos), f"events out of order: {events}")

step("watch events carry entry info, as get_info gives it")
h = sbx.files.watch_dir("/home/user/w", include_entry=True)
sbx.files.write("/home/user/w/e.txt", "12345", metadata={"k": "v"})
sbx.commands.run("ln -s e.txt /home/user/w/l")
deadline = time.time() + 10
entries = {}
while time.time() < deadline and not {"e.txt", "l"} <= entries.keys():
    for e in h.get_new_events():
        if e.entry is not None:
            entries[e.name] = e.entry
    time.sleep(0.3)
h.stop()
entry = entries.get("e.txt")
expect(entry is not None, f"no event with entry info: {entries}")
expect(entry.type == FileType.FILE and entry.path == "/home/user/w/e.txt", f"entry {entry}")
expect(entry.owner == "user", f"entry owner {entry}")
expect(entry.metadata == {"k": "v"}, f"entry metadata {entry}")
link = entries.get("l")
expect(link is not None, f"no entry for the link: {entries}")
expect(link.type == FileType.FILE, f"a link's entry has its target's type: {link}")
expect(link.symlink_target == "/home/user/w/e.txt", f"link target {link}")

step("a watch that allows network mounts (envd 0.6.4) works like any other")
h = sbx.files.watch_dir("/home/user/w", allow_network_mounts=True)
sbx.files.write("/home/user/w/n.txt", "n")
deadline = time.time() + 10
seen = set()
while time.time() < deadline and "n.txt" not in seen:
    seen |= {e.name for e in h.get_new_events()}
    time.sleep(0.3)
h.stop()
expect("n.txt" in seen, f"no event for n.txt: {seen}")

step("file metadata is kept (the rest of it: metadata.py)")
w = sbx.files.write("/home/user/meta.txt", "x", metadata={"k": "v"})
expect(w.metadata == {"k": "v"}, f"metadata kept: {w}")
expect(sbx.files.get_info("/home/user/meta.txt").metadata == {"k": "v"}, "and read back")

sbx.kill()
print("ALL OK")
