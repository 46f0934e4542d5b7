"""E2B SDK against torpor vs torpor's own API, in the same run, from the same Python process.

Environment: E2B_API_KEY / E2B_API_URL / E2B_SANDBOX_URL (the SDK), TORPOR_URL and
TORPOR_TOKEN (the native API, same tenant), BENCH_N. Prints a table and one JSON line.
"""
import json
import os
import statistics
import time

import httpx
from e2b import Sandbox

N = int(os.environ.get("BENCH_N", "30"))
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
for _ in range(3):  # warm both paths
    sbx.commands.run("true")
    exec_native(sid, ["/bin/bash", "-l", "-c", "true"])

rows.append((
    'commands.run("true") (SDK → adapter → bash -l -c)',
    [ms(lambda: sbx.commands.run("true")) for _ in range(N)],
    "native exec of bash -l -c true (POST /v1/.../exec)",
    [ms(lambda: exec_native(sid, ["/bin/bash", "-l", "-c", "true"])) for _ in range(N)],
))

connect_ms, resume_ms = [], []
for _ in range(max(3, N // 3)):
    sbx.pause()
    connect_ms.append(ms(lambda: Sandbox.connect(sid)))
    sbx.commands.run("true")
    r = native.post(f"/v1/sandboxes/{sid}/suspend", json={"tier": "parked"})
    r.raise_for_status()
    resume_ms.append(ms(lambda: native.post(f"/v1/sandboxes/{sid}/resume").raise_for_status()))
    exec_native(sid, ["true"])
rows.append(("Sandbox.connect of a paused sandbox (SDK)", connect_ms, "native resume of a parked sandbox", resume_ms))

create_ms, ncreate_ms, made = [], [], []
for _ in range(max(3, N // 3)):
    holder = {}
    create_ms.append(ms(lambda: holder.setdefault("s", Sandbox.create(timeout=600))))
    made.append(holder["s"].sandbox_id)
    def nc():
        r = native.post("/v1/sandboxes", json={"template": "host"})
        r.raise_for_status()
        made.append(r.json()["id"])
    ncreate_ms.append(ms(nc))
for m in made:
    native.delete(f"/v1/sandboxes/{m}")
rows.append(("Sandbox.create (SDK)", create_ms, "native create (POST /v1/sandboxes)", ncreate_ms))
sbx.kill()

print(f"{'row':58} {'p50 ms':>8} {'p95 ms':>8} | {'baseline':52} {'p50 ms':>8} {'p95 ms':>8}")
out = []
for name, t, bname, b in rows:
    t50, t95, b50, b95 = pct(t, 50), pct(t, 95), pct(b, 50), pct(b, 95)
    print(f"{name:58} {t50:8.2f} {t95:8.2f} | {bname:52} {b50:8.2f} {b95:8.2f}")
    out.append({"row": name, "n": len(t), "p50_ms": round(t50, 3), "p95_ms": round(t95, 3),
                "baseline": bname, "baseline_p50_ms": round(b50, 3), "baseline_p95_ms": round(b95, 3),
                "overhead_p50_ms": round(t50 - b50, 3)})
print(json.dumps({"bench": "e2b", "n": N, "rows": out}))
