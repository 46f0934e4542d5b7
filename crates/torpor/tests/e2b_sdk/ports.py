"""Ports of an E2B sandbox through the official, unmodified e2b Python SDK: get_host(port) and
torpor's host-based routing, waking a paused sandbox.

Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (torpor's listener), TORPOR_ADDR
(host:port of that listener: there is no DNS for the sandbox names here, so requests go to
torpor's address with the name in the Host header), EXPECT_DOMAIN (the daemon's proxy domain).
"""
import http.client
import os
import time

from e2b import Sandbox

ADDR = os.environ["TORPOR_ADDR"]
DOMAIN = os.environ["EXPECT_DOMAIN"]


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def get(host, path, headers=None):
    h, p = ADDR.rsplit(":", 1)
    conn = http.client.HTTPConnection(h, int(p), timeout=120)
    conn.request("GET", path, headers={"Host": host, **(headers or {})})
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    conn.close()
    return r.status, body


def wait_served(host, path):
    deadline = time.time() + 60
    while True:
        status, body = get(host, path)
        if status == 200:
            return body
        expect(time.time() < deadline, f"never served: {status} {body}")
        time.sleep(0.2)


step("create and serve")
sbx = Sandbox.create(timeout=600)
# HTTP/1.1 keeps the sandbox from closing first (its TIME_WAIT would block a checkpoint).
sbx.commands.run(
    "cd /tmp && echo served-by-$HOSTNAME-e2b > hello.txt && "
    "exec python3 -m http.server -p HTTP/1.1 8080",
    background=True,
)
host = sbx.get_host(8080)
expect(host == f"8080-{sbx.sandbox_id}.{DOMAIN}", f"get_host: {host}")
body = wait_served(host, "/hello.txt")
expect(body.strip().endswith("-e2b"), f"body {body!r}")
print("served:", body.strip(), flush=True)

step("pause, then a request wakes it")
sbx.pause()
expect(sbx.get_info().state.value == "paused", "paused")
status, body2 = get(host, "/hello.txt")
expect((status, body2) == (200, body), f"after pause: {status} {body2!r}")
expect(sbx.get_info().state.value == "running", "woken by the request")

step("unknown port and unknown sandbox")
status, _ = get(f"8081-{sbx.sandbox_id}.{DOMAIN}", "/")
expect(status == 502, f"nothing on 8081: {status}")
status, body = get(f"8080-sb-nosuchsandbox0000.{DOMAIN}", "/")
expect(status == 401, f"unknown sandbox: {status} {body}")

step("private traffic")
priv = Sandbox.create(timeout=600, network={"allow_public_traffic": False})
token = priv.traffic_access_token
expect(token, "a private sandbox has a traffic access token")
priv.commands.run(
    "cd /tmp && echo private > hello.txt && exec python3 -m http.server -p HTTP/1.1 8080",
    background=True,
)
phost = priv.get_host(8080)
status, _ = get(phost, "/hello.txt")
expect(status == 401, f"no token: {status}")
status, _ = get(phost, "/hello.txt", {"e2b-traffic-access-token": "wrong"})
expect(status == 401, f"wrong token: {status}")
deadline = time.time() + 60
while True:
    status, body = get(phost, "/hello.txt", {"e2b-traffic-access-token": token})
    if status == 200:
        break
    expect(status != 401 and time.time() < deadline, f"with token: {status} {body}")
    time.sleep(0.2)
expect(body.strip() == "private", body)
expect(sbx.traffic_access_token is None, "public sandboxes have none")

priv.kill()
sbx.kill()
print("ALL OK", flush=True)
