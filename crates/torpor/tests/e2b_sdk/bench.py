"""E2B SDK against torpor vs torpor's own API, in the same run, from the same Python process.

Environment: E2B_API_KEY / E2B_API_URL / E2B_SANDBOX_URL (the SDK), TORPOR_URL and
TORPOR_TOKEN (the native API, same tenant), BENCH_N (rounds of the create and connect rows),
BENCH_RUN_N (rounds of the `commands.run` rows: cheap, and their differences are a fraction of a
millisecond in a spread of several, so at least 100 by default), BENCH_CREATE_RATES (creates per second for
the create-rate rows, comma-separated, `inf` = all at once; default 1,2,4,inf), BENCH_ROWS
(`run`: only the `commands.run` rows and the spawn floors; default all). Prints a table and one
JSON line.
"""
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from e2b import Sandbox

N = int(os.environ.get("BENCH_N", "30"))
RUN_N = int(os.environ.get("BENCH_RUN_N") or max(N, 100))
ONLY_RUN = os.environ.get("BENCH_ROWS", "all") == "run"
url = os.environ["TORPOR_URL"]
native = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {os.environ['TORPOR_TOKEN']}"}, timeout=120)


def ms(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1000


def pct(v, p):
    v = sorted(v)
    return v[round(p / 100 * (len(v) - 1))]


def exec_native(sid, cmd):
    r = native.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    r.raise_for_status()
    assert r.json()["exit_code"] == 0, r.text


rows = []
sbx = Sandbox.create(timeout=3600)
sid = sbx.sandbox_id
# The same `base` sandbox whose agent answers a process's start at once (protocol 6's way):
# `commands.run` then gets its start event while the command runs and the rest in a second
# write, where the held start answers a short command whole (see envd's `Start`).
AT_ONCE = "TORPOR_AGENT_BENCH_SPAWNED_AT_ONCE"
sbx_at_once = Sandbox.create(timeout=3600, envs={AT_ONCE: "1"})
detail = httpx.get(f"{url}/sandboxes/{sid}", headers={"X-API-KEY": os.environ["E2B_API_KEY"]}).json()
envd = httpx.Client(base_url=os.environ["E2B_SANDBOX_URL"], timeout=120, headers={
    "E2b-Sandbox-Id": sid,
    "X-Access-Token": detail["envdAccessToken"],
    "Content-Type": "application/connect+json",
    "Connect-Protocol-Version": "1",
})
START = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"], "envs": {}}}).encode()
START = b"\0" + len(START).to_bytes(4, "big") + START


def raw_start():
    """process.Process/Start over plain httpx: the adapter without the SDK's client code."""
    r = envd.post("/process.Process/Start", content=START)
    assert b'exit status 0' in r.content, r.content
    return r


# The switch took: a short command is answered whole (with its length) in `sbx` at least once
# in a few tries, never in `sbx_at_once`.
assert any("content-length" in raw_start().headers for _ in range(5)), "never answered whole"
once_detail = httpx.get(f"{url}/sandboxes/{sbx_at_once.sandbox_id}",
                        headers={"X-API-KEY": os.environ["E2B_API_KEY"]}).json()
for _ in range(3):
    r = envd.post("/process.Process/Start", content=START, headers={
        "E2b-Sandbox-Id": sbx_at_once.sandbox_id, "X-Access-Token": once_detail["envdAccessToken"]})
    assert "content-length" not in r.headers and b'exit status 0' in r.content, (r.headers, r.content)

for _ in range(3):  # warm every path
    sbx.commands.run("true")
    sbx_at_once.commands.run("true")
    sbx.commands.run("true", user="root")
    exec_native(sid, ["/bin/bash", "-l", "-c", "true"])
    raw_start()

# Interleaved, in alternating order, so that load drift on a shared machine hits every path
# alike; the overhead is also reported as the median of per-round differences.
# `base` runs commands as `user` (a uid switch and that user's login shell) where the native
# exec runs as root: the `user="root"` path is the same command as the native one.
sdk_ms, root_ms, raw_ms, nat_ms, once_ms = [], [], [], [], []
paths = [
    (sdk_ms, lambda: sbx.commands.run("true")),
    (once_ms, lambda: sbx_at_once.commands.run("true")),
    (root_ms, lambda: sbx.commands.run("true", user="root")),
    (raw_ms, raw_start),
    (nat_ms, lambda: exec_native(sid, ["/bin/bash", "-l", "-c", "true"])),
]
for i in range(RUN_N):
    for out, f in (paths if i % 2 == 0 else paths[::-1]):
        out.append(ms(f))
rows.append((
    'commands.run("true") (SDK → adapter → bash -l -c)', sdk_ms,
    "native exec of bash -l -c true (POST /v1/.../exec)", nat_ms,
))
rows.append((
    'commands.run("true", user="root") (SDK, as root like the native exec)', root_ms,
    "native exec of bash -l -c true (POST /v1/.../exec)", nat_ms,
))
rows.append((
    "process.Process/Start, raw Connect (httpx, no SDK)", raw_ms,
    "native exec of bash -l -c true (POST /v1/.../exec)", nat_ms,
))
rows.append((
    'commands.run("true"), start held: answered whole (now)', sdk_ms,
    "the same, start event at once (before)", once_ms,
))
paired = {
    "sdk_minus_native": statistics.median(a - b for a, b in zip(sdk_ms, nat_ms)),
    "sdk_as_root_minus_native": statistics.median(a - b for a, b in zip(root_ms, nat_ms)),
    "raw_connect_minus_native": statistics.median(a - b for a, b in zip(raw_ms, nat_ms)),
    "sdk_minus_raw_connect": statistics.median(a - b for a, b in zip(sdk_ms, raw_ms)),
    "sdk_minus_start_at_once": statistics.median(a - b for a, b in zip(sdk_ms, once_ms)),
    "start_at_once_minus_native": statistics.median(a - b for a, b in zip(once_ms, nat_ms)),
}
sbx_at_once.kill()

# Spawn floors inside the same sandbox, torpor off the path: `bash -l -c true` started N times
# by the agent binary's floor mode (`--torpor-spawn-floor`), as root (what the native exec
# starts), as `user` the way the agent's `Spawn` now starts it (clone(CLONE_VM|CLONE_VFORK)),
# and as `user` through the standard library's fork fallback (what it did before).
AGENT = ["/.torpor/ld.so", "--library-path", "/.torpor/lib", "/.torpor/torpor", "sandbox-agent", "--",
         "--torpor-spawn-floor"]
BASH_TRUE = ["/bin/bash", "-l", "-c", "true"]
floors = {"root": [], "user_vfork": [], "user_fork": []}
for i in range(3):
    for name, extra in (("root", []), ("user_vfork", ["--uid", "1000:1000"]),
                        ("user_fork", ["--uid-std", "1000:1000"])):
        r = native.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": AGENT + [str(max(5, N // 3))] + extra + BASH_TRUE})
        r.raise_for_status()
        assert r.json()["exit_code"] == 0, r.text
        floors[name] += [us / 1000 for us in json.loads(r.json()["stdout"].splitlines()[0])["spawn_us"]]

connect_ms, resume_ms = [], []
for _ in range(0 if ONLY_RUN else max(3, N // 3)):
    sbx.pause()
    connect_ms.append(ms(lambda: Sandbox.connect(sid)))
    sbx.commands.run("true")
    r = native.post(f"/v1/sandboxes/{sid}/suspend", json={"tier": "parked"})
    r.raise_for_status()
    resume_ms.append(ms(lambda: native.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()))
    exec_native(sid, ["true"])
if not ONLY_RUN:
    rows.append(("Sandbox.connect of a paused sandbox (SDK)", connect_ms, "native resume of a parked sandbox", resume_ms))

# One create at a time (the rate the machine sustains serially), alternating the E2B create
# (template `base`, with a network interface) with native creates of `host` and of `base`; the
# native `base` is given a network as E2B's is (ingress only: `{"allow": []}`), so that the
# difference is the adapter's and not gVisor's network stack (~25-45 ms of a restore here:
# `--bench create_rate`'s floor).
NET = {"allow": []}
create_ms, ncreate_ms, nbase_ms, made = [], [], [], []
for _ in range(0 if ONLY_RUN else max(3, N // 3)):
    holder = {}
    create_ms.append(ms(lambda: holder.setdefault("s", Sandbox.create(timeout=600))))
    made.append(holder["s"].sandbox_id)
    def nc(template, network=None):
        body = {"template": template} if network is None else {"template": template, "network": network}
        r = native.post("/v1/sandboxes", json=body)
        r.raise_for_status()
        made.append(r.json()["id"])
    ncreate_ms.append(ms(lambda: nc("host")))
    nbase_ms.append(ms(lambda: nc("base", NET)))
for m in made:
    native.delete(f"/v1/sandboxes/{m}")
if not ONLY_RUN:
    rows.append(("Sandbox.create (SDK)", create_ms, "native create (POST /v1/sandboxes)", ncreate_ms))
    rows.append(("Sandbox.create (SDK)", create_ms, "native create of base, networked", nbase_ms))
    paired["create_minus_native_create"] = statistics.median(a - b for a, b in zip(create_ms, ncreate_ms))
    paired["create_minus_native_base_create"] = statistics.median(a - b for a, b in zip(create_ms, nbase_ms))

# Creates at offered rates (open loop): E2B creates and native networked creates of `base` alternate,
# one every 1/(2r) s, so each kind is offered r per second and neither always starts just
# before the other (the engine admits restores one at a time: side by side, the request that
# leaves the client first would win every time). Each sandbox is deleted as soon as its create
# answered, so the node's workers are not what runs out. `inf`: all at once.
RATES = [] if ONLY_RUN else [float(r) for r in os.environ.get("BENCH_CREATE_RATES", "1,2,4,inf").split(",") if r]
K = max(4, N // 4)


def timed_create(kind):
    t = time.perf_counter()
    if kind == "e2b":
        made_id = Sandbox.create(timeout=600).sandbox_id
    else:
        r = native.post("/v1/sandboxes", json={"template": "base", "network": NET})
        r.raise_for_status()
        made_id = r.json()["id"]
    took = (time.perf_counter() - t) * 1000
    native.delete(f"/v1/sandboxes/{made_id}").raise_for_status()
    return kind, took


rate_rows = []
for rate in RATES:
    with ThreadPoolExecutor(max_workers=2 * K) as pool:
        t0, jobs = time.perf_counter(), []
        for i in range(2 * K):
            if rate != float("inf"):
                time.sleep(max(0.0, t0 + i / (2 * rate) - time.perf_counter()))
            jobs.append(pool.submit(timed_create, "e2b" if (i + i // 2) % 2 == 0 else "native"))
        results = [j.result() for j in jobs]
    e2b_t = [t for k, t in results if k == "e2b"]
    nat_t = [t for k, t in results if k == "native"]
    rate_rows.append({"offered_per_s": "all at once" if rate == float("inf") else rate, "n": K,
                      "e2b_p50_ms": round(pct(e2b_t, 50), 3), "e2b_p95_ms": round(pct(e2b_t, 95), 3),
                      "native_base_p50_ms": round(pct(nat_t, 50), 3),
                      "native_base_p95_ms": round(pct(nat_t, 95), 3),
                      "overhead_p50_ms": round(pct(e2b_t, 50) - pct(nat_t, 50), 3)})
sbx.kill()

print(f"{'row':70} {'p50 ms':>8} {'p95 ms':>8} | {'baseline':44} {'p50 ms':>8} {'p95 ms':>8}")
out = []
for name, t, bname, b in rows:
    t50, t95, b50, b95 = pct(t, 50), pct(t, 95), pct(b, 50), pct(b, 95)
    print(f"{name:70} {t50:8.2f} {t95:8.2f} | {bname:44} {b50:8.2f} {b95:8.2f}")
    out.append({"row": name, "n": len(t), "p50_ms": round(t50, 3), "p95_ms": round(t95, 3),
                "baseline": bname, "baseline_p50_ms": round(b50, 3), "baseline_p95_ms": round(b95, 3),
                "overhead_p50_ms": round(t50 - b50, 3)})
print()
print("paired medians of per-round differences (same round, interleaved):")
for k, v in paired.items():
    print(f"  {k:32} {v:+8.2f} ms")
print()
print("in-sandbox spawn floors of bash -l -c true (no torpor on the path), p50 / p95 ms:")
for k, v in floors.items():
    print(f"  {k:32} {pct(v, 50):8.2f} {pct(v, 95):8.2f}  (n={len(v)})")
print()
print(f"Sandbox.create (SDK) vs native networked create of base at offered rates, n = {K} each, deleted at once:")
print(f"  {'offered':14} {'SDK p50':>9} {'SDK p95':>9} {'base p50':>9} {'base p95':>9} {'overhead p50':>13}")
for r in rate_rows:
    off = r["offered_per_s"] if isinstance(r["offered_per_s"], str) else f"{r['offered_per_s']:g}/s"
    print(f"  {off:14} {r['e2b_p50_ms']:9.1f} {r['e2b_p95_ms']:9.1f} {r['native_base_p50_ms']:9.1f} "
          f"{r['native_base_p95_ms']:9.1f} {r['overhead_p50_ms']:+13.1f}")
print(json.dumps({"bench": "e2b", "n": N, "run_n": RUN_N, "rows": out, "create_rates": rate_rows,
                  "paired_median_ms": {k: round(v, 3) for k, v in paired.items()},
                  "spawn_floor_p50_ms": {k: round(pct(v, 50), 3) for k, v in floors.items()}}))
