"""E2B's file metadata (envd 0.6.2, issue 19), through the official, unmodified e2b Python SDK:
`files.write(..., metadata=...)` keeps it as `user.e2b.*` extended attributes, `get_info` and
`list` surface it as `metadata`, a rename keeps it, an overwrite clears or replaces it, what a
process sets in the sandbox by hand shows too, and what envd would refuse is refused (400).

With OLD_AGENT_TEMPLATE set (a template whose agent says an older protocol, as a sandbox
restored from an older torpor's snapshot): such a sandbox is never sent the metadata requests
(its agent could not parse them), lists no metadata, and refuses an upload with metadata.

Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (torpor's listener), OLD_AGENT_TEMPLATE.
"""
import os

import httpx
from e2b import Sandbox
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.exceptions import InvalidArgumentException


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def xattrs(sbx, path):
    """The file's extended attributes as the sandbox itself sees them (name -> value)."""
    script = (
        "import os,sys,json; p=sys.argv[1]; "
        "print(json.dumps({n: os.getxattr(p, n).decode() for n in sorted(os.listxattr(p))}))"
    )
    r = sbx.commands.run(f"python3 -c '{script}' {path}")
    import json

    return json.loads(r.stdout)


sbx = Sandbox.create(timeout=600, secure=True)
home = "/home/user"

step("a write with metadata answers it, stored as user.e2b.* attributes (keys lowercased)")
w = sbx.files.write(f"{home}/doc.txt", "v1", metadata={"Author": "mish", "purpose": "upload"})
want = {"author": "mish", "purpose": "upload"}
expect(w.metadata == want, f"write answers the metadata kept: {w}")
expect(
    xattrs(sbx, f"{home}/doc.txt") == {"user.e2b.author": "mish", "user.e2b.purpose": "upload"},
    f"the sandbox sees user.e2b.* attributes: {xattrs(sbx, f'{home}/doc.txt')}",
)

step("get_info and list surface it; an entry without any has None")
expect(sbx.files.get_info(f"{home}/doc.txt").metadata == want, "get_info")
sbx.files.write(f"{home}/plain.txt", "x")
by_name = {e.name: e for e in sbx.files.list(home)}
expect(by_name["doc.txt"].metadata == want, f"list: {by_name['doc.txt']}")
expect(by_name["plain.txt"].metadata is None, f"no metadata is None: {by_name['plain.txt']}")
expect(sbx.files.get_info(f"{home}/plain.txt").metadata is None, "get_info without metadata")
deep = {e.path: e for e in sbx.files.list("/home", depth=2)}
expect(deep[f"{home}/doc.txt"].metadata == want, "list at depth 2")

step("a rename keeps it, and the renamed entry says so")
moved = sbx.files.rename(f"{home}/doc.txt", f"{home}/moved.txt")
expect(moved.metadata == want, f"rename answers it: {moved}")
expect(sbx.files.get_info(f"{home}/moved.txt").metadata == want, "after rename")
sbx.files.make_dir(f"{home}/sub")
sbx.files.rename(f"{home}/moved.txt", f"{home}/sub/moved.txt")
expect(sbx.files.get_info(f"{home}/sub/moved.txt").metadata == want, "moved into a directory")

step("an overwrite without metadata clears it; with other metadata replaces the whole set")
w = sbx.files.write(f"{home}/sub/moved.txt", "v2")
expect(w.metadata is None, f"overwrite answers none: {w}")
expect(sbx.files.get_info(f"{home}/sub/moved.txt").metadata is None, "cleared on overwrite")
sbx.files.write(f"{home}/sub/moved.txt", "v3", metadata={"a": "1", "b": "2"})
sbx.files.write(f"{home}/sub/moved.txt", "v4", metadata={"b": "3"})
expect(sbx.files.get_info(f"{home}/sub/moved.txt").metadata == {"b": "3"}, "replaced whole")
expect(sbx.files.read(f"{home}/sub/moved.txt") == "v4", "the content is the last write's")

step("octet-stream and gzip uploads, and write_files, carry it to every file")
sbx.files.write(f"{home}/o.bin", b"\x00\x01", use_octet_stream=True, metadata={"k": "o"})
sbx.files.write(f"{home}/g.txt", "gz" * 1000, gzip=True, metadata={"k": "g"})
expect(sbx.files.get_info(f"{home}/o.bin").metadata == {"k": "o"}, "octet-stream")
expect(sbx.files.get_info(f"{home}/g.txt").metadata == {"k": "g"}, "gzip")
many = sbx.files.write_files(
    [WriteEntry(path=f"{home}/m1.txt", data="1"), WriteEntry(path=f"{home}/m2.txt", data="2")],
    metadata={"batch": "yes"},
)
expect([m.metadata for m in many] == [{"batch": "yes"}] * 2, f"write_files: {many}")
expect(sbx.files.get_info(f"{home}/m2.txt").metadata == {"batch": "yes"}, "each file")

step("as root, and what a process sets by hand, shows too (other namespaces do not)")
sbx.files.write("/root/r.txt", "r", user="root", metadata={"who": "root"})
expect(sbx.files.get_info("/root/r.txt", user="root").metadata == {"who": "root"}, "root's file")
sbx.commands.run(
    f"python3 -c \"import os; os.setxattr('{home}/plain.txt', 'user.e2b.hand', b'set'); "
    f"os.setxattr('{home}/plain.txt', 'user.other', b'not e2b')\""
)
expect(sbx.files.get_info(f"{home}/plain.txt").metadata == {"hand": "set"}, "set by hand")

step("a symlink shows its target's metadata")
sbx.commands.run(f"ln -s {home}/m1.txt {home}/link")
expect(sbx.files.get_info(f"{home}/link").metadata == {"batch": "yes"}, "through the link")

step("the SDK refuses what it can tell is invalid; torpor refuses the rest as envd does (400)")
try:
    sbx.files.write(f"{home}/bad.txt", "x", metadata={"k": "caf\u00e9"})
    raise AssertionError("a non-ASCII value was accepted by the SDK")
except InvalidArgumentException:
    pass
url = sbx.upload_url(f"{home}/raw.txt")
for headers, why in [
    ({"X-Metadata-k": "v" * 4090}, "over 4096 bytes in all"),
    ({"X-Metadata-" + "k" * 247: "v"}, "a key over 246 bytes"),
    # 60 keys of 60 bytes with empty values: 4140 bytes once each key's prefix is counted.
    ({f"X-Metadata-{i:02d}{'k' * 58}": "" for i in range(60)}, "keys whose prefixes tip the total"),
]:
    r = httpx.post(url, files={"file": ("raw.txt", b"x")}, headers=headers)
    expect(r.status_code == 400, f"{why}: {r.status_code} {r.text}")
    body = r.json()
    expect(body["code"] == 400 and body["message"].startswith("invalid metadata"), f"{why}: {body}")
r = httpx.post(url, files={"file": ("raw.txt", b"x")}, headers={b"X-Metadata-k": b"\xff"})
expect(r.status_code == 400, f"a non-ASCII byte: {r.status_code} {r.text}")
expect(not sbx.files.exists(f"{home}/raw.txt"), "nothing was written by a refused upload")
r = httpx.post(url, files={"file": ("raw.txt", b"x")}, headers={"X-Metadata-k": "v" * 4086})
expect(r.status_code == 200, f"exactly 4096 bytes is accepted: {r.status_code} {r.text}")
expect(r.json()[0]["metadata"] == {"k": "v" * 4086}, "answered")

step("metadata survives a pause and resume")
sbx.pause()
sbx = Sandbox.connect(sbx.sandbox_id)
expect(sbx.files.get_info(f"{home}/m1.txt").metadata == {"batch": "yes"}, "after resume")

sbx.kill()

step("an agent older than file metadata: never asked, nothing listed, uploads refused")
old = Sandbox.create(template=os.environ["OLD_AGENT_TEMPLATE"], timeout=600)
w = old.files.write("/tmp/plain.txt", "x")
expect(w.metadata is None, f"a write without metadata works: {w}")
try:
    old.files.write("/tmp/meta.txt", "x", metadata={"k": "v"})
    raise AssertionError("metadata was accepted by an agent that cannot keep it")
except InvalidArgumentException as e:
    expect("newer sandbox agent" in str(e), f"the refusal says why: {e}")
expect(not old.files.exists("/tmp/meta.txt"), "nothing written")
old.commands.run("python3 -c \"import os; os.setxattr('/tmp/plain.txt', 'user.e2b.k', b'v')\"")
expect(old.files.get_info("/tmp/plain.txt").metadata is None, "stat asks for none")
expect(all(e.metadata is None for e in old.files.list("/tmp")), "list asks for none")
old.kill()
print("ALL OK", flush=True)
