"""E2B's named snapshots (issue 19), through the official, unmodified e2b Python SDK: create a
snapshot of a sandbox (instance and class-method forms), list them (all, per sandbox, by
name, paged), create sandboxes from one (by id and by name), keep them after their source is
killed, replace one under the same name, delete them, and keep them from another tenant.

Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (torpor's listener), OTHER_KEY (a
second tenant's key).
"""
import os

from e2b import Sandbox


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def state(s):
    return s.commands.run("cat /home/user/state.txt").stdout.strip()


OTHER = os.environ["OTHER_KEY"]

sbx = Sandbox.create(timeout=600)
sbx.commands.run("echo one > /home/user/state.txt")

step("create_snapshot: instance form, named")
snap = sbx.create_snapshot("nightly")
expect(snap.snapshot_id.endswith("/nightly:default"), f"named id {snap}")
expect(snap.names == [snap.snapshot_id], f"names {snap}")
expect(sbx.is_running(), "the source goes on running")
sbx.commands.run("echo two > /home/user/state.txt")

step("create_snapshot: class-method form, unnamed")
unnamed = Sandbox.create_snapshot(sbx.sandbox_id)
expect(unnamed.snapshot_id.endswith(":default") and unnamed.names == [], f"unnamed {unnamed}")
holder = unnamed.snapshot_id.split(":")[0]

step("list_snapshots: all, per sandbox, by name, paged")
ids = lambda items: [s.snapshot_id for s in items]  # noqa: E731
everything = ids(Sandbox.list_snapshots().next_items())
expect(everything == [unnamed.snapshot_id, snap.snapshot_id], f"all, newest first: {everything}")
expect(ids(sbx.list_snapshots().next_items()) == everything, "per sandbox (instance form)")
expect(
    ids(Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()) == everything,
    "per sandbox (class form)",
)
expect(ids(Sandbox.list_snapshots(name="nightly").next_items()) == [snap.snapshot_id], "by name")
expect(
    ids(Sandbox.list_snapshots(name=snap.snapshot_id).next_items()) == [snap.snapshot_id],
    "by full id",
)
p = Sandbox.list_snapshots(limit=1)
expect(ids(p.next_items()) == [unnamed.snapshot_id] and p.has_next, "page 1")
expect(ids(p.next_items()) == [snap.snapshot_id] and not p.has_next, "page 2")

step("snapshots are not sandboxes")
listed = [s.sandbox_id for s in Sandbox.list().next_items()]
expect(holder not in listed, f"a snapshot is listed as a sandbox: {listed}")
try:
    Sandbox.connect(holder)
    raise AssertionError("a snapshot was connected to as a sandbox")
except AssertionError:
    raise
except Exception:
    pass

step("Sandbox.create from a snapshot: by id, by name")
a = Sandbox.create(snap.snapshot_id, timeout=300, metadata={"from": "nightly"})
expect(state(a) == "one", "created by id: the snapshot's files")
expect(a.get_info().metadata == {"from": "nightly"}, f"its own metadata {a.get_info().metadata}")
b = Sandbox.create("nightly")
expect(state(b) == "one", "created by name")
c = Sandbox.create(unnamed.snapshot_id)
expect(state(c) == "two", "created from the unnamed snapshot")
b.kill()
c.kill()

step("snapshots outlive their source")
sbx.kill()
d = Sandbox.create(snap.snapshot_id)
expect(state(d) == "one", "after the source was killed")
d.kill()

step("another tenant sees and uses none of them")
expect(Sandbox.list_snapshots(api_key=OTHER).next_items() == [], "other tenant's list")
expect(Sandbox.delete_snapshot(snap.snapshot_id, api_key=OTHER) is False, "other tenant's delete")
try:
    Sandbox.create(snap.snapshot_id, api_key=OTHER)
    raise AssertionError("another tenant created a sandbox from this tenant's snapshot")
except AssertionError:
    raise
except Exception:
    pass

step("a new snapshot under a name replaces it")
a.commands.run("echo three > /home/user/state.txt")
snap2 = a.create_snapshot("nightly")
expect(ids(Sandbox.list_snapshots(name="nightly").next_items()) == [snap2.snapshot_id], "one nightly")
e = Sandbox.create("nightly")
expect(state(e) == "three", "the newest under the name")
e.kill()
a.kill()

step("delete_snapshot")
expect(Sandbox.delete_snapshot(snap2.snapshot_id) is True, "deleted")
expect(Sandbox.delete_snapshot(snap2.snapshot_id) is False, "deleted twice")
expect(Sandbox.delete_snapshot(unnamed.snapshot_id) is True, "unnamed deleted")
expect(Sandbox.list_snapshots().next_items() == [], "none left")
try:
    Sandbox.create("nightly")
    raise AssertionError("created from a deleted snapshot")
except AssertionError:
    raise
except Exception:
    pass

print("ALL OK")
