"""E2B's egress options through the official, unmodified e2b Python SDK: allow_internet_access,
network allow_out / deny_out at create, update_network, get_info's network, mask_request_host,
and the refusals (a template that limits egress, options torpor does not implement).

Environment: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL (torpor's listener), TORPOR_ADDR
(host:port of that listener), EXPECT_DOMAIN (the proxy domain), HOST_IP (an address of this
host that sandboxes reach through their egress), FULL_TEMPLATE (a template whose network is
"full"; the default template has no network).
"""
import http.client
import http.server
import os
import threading
import time

from e2b import CommandExitException, Sandbox
from e2b.exceptions import SandboxException

ADDR = os.environ["TORPOR_ADDR"]
DOMAIN = os.environ["EXPECT_DOMAIN"]
HOST_IP = os.environ["HOST_IP"]
FULL = os.environ["FULL_TEMPLATE"]
ALL_TRAFFIC = "0.0.0.0/0"


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello-from-host"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Hello)
threading.Thread(target=server.serve_forever, daemon=True).start()
URL = f"http://{HOST_IP}:{server.server_address[1]}/"

FETCH = (
    "python3 -c \"import sys,urllib.request;"
    "print(urllib.request.urlopen(sys.argv[1],timeout=3).read().decode())\" "
)


def reaches_host(sbx):
    try:
        r = sbx.commands.run(FETCH + URL, timeout=60)
    except CommandExitException:
        return False
    return r.stdout.strip() == "hello-from-host"


def refused(what, f):
    try:
        f()
    except SandboxException as e:
        print(f"refused as expected ({what}): {e}", flush=True)
        return str(e)
    raise AssertionError(f"{what}: not refused")


made = []


def create(**kw):
    s = Sandbox.create(timeout=600, **kw)
    made.append(s)
    return s


step("a template with a full network: egress by default")
s = create(template=FULL)
expect(reaches_host(s), "full template reaches the host")
expect(s.get_info().allow_internet_access is None, "nothing asked")

step("allow_internet_access=False")
s = create(template=FULL, allow_internet_access=False)
expect(not reaches_host(s), "no internet access")
expect(s.get_info().allow_internet_access is False, "get_info answers it back")

step("deny all, allow one address: an allowlist")
s = create(template=FULL, network={"deny_out": [ALL_TRAFFIC], "allow_out": [HOST_IP]})
expect(reaches_host(s), "allowed address")
net = s.get_info().network
expect(net["allow_out"] == [HOST_IP] and net["deny_out"] == [ALL_TRAFFIC], f"info {net}")

step("a partial deny, then update_network")
s = create(template=FULL, network={"deny_out": [f"{HOST_IP}/32"]})
expect(not reaches_host(s), "denied address")
s.update_network({"deny_out": ["10.0.0.0/8"]})
expect(reaches_host(s), "anything not denied is allowed")
s.update_network({"deny_out": [HOST_IP], "allow_out": [HOST_IP]})
expect(reaches_host(s), "an allowed entry wins over a denied one")
s.update_network({"allow_internet_access": False})
expect(not reaches_host(s), "update to no internet")
expect(s.get_info().network.get("deny_out") is None, "replaced as a whole")

step("the default template (no network) is only narrowed")
s = create(allow_internet_access=False)
expect(not reaches_host(s), "ingress only")
msg = refused(
    "widening a limited template",
    lambda: create(network={"deny_out": [ALL_TRAFFIC], "allow_out": [HOST_IP]}),
)
expect("limits egress" in msg, msg)

step("bad options")
refused("a name in deny_out", lambda: create(template=FULL, network={"deny_out": ["example.com"]}))
refused("a bad CIDR", lambda: create(template=FULL, network={"allow_out": ["1.2.3.4/40"]}))
refused(
    "egress_proxy",
    lambda: create(template=FULL, network={"egress_proxy": {"address": "proxy.example:1080"}}),
)

step("mask_request_host: the Host the sandbox's server sees")
s = create(template=FULL, network={"mask_request_host": "${PORT}-masked.example"})
s.commands.run(
    "cat > /tmp/h.py <<'EOF'\n"
    "import http.server\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    protocol_version = 'HTTP/1.1'\n"
    "    def do_GET(self):\n"
    "        b = self.headers['Host'].encode()\n"
    "        self.send_response(200); self.send_header('Content-Length', str(len(b)))\n"
    "        self.end_headers(); self.wfile.write(b)\n"
    "http.server.HTTPServer(('0.0.0.0', 8080), H).serve_forever()\n"
    "EOF"
)
s.commands.run("exec python3 /tmp/h.py", background=True)
expect(s.get_info().network["mask_request_host"] == "${PORT}-masked.example", "info")
h, p = ADDR.rsplit(":", 1)
deadline = time.time() + 60
while True:
    conn = http.client.HTTPConnection(h, int(p), timeout=60)
    conn.request("GET", "/", headers={"Host": s.get_host(8080)})
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    conn.close()
    if r.status == 200:
        break
    expect(time.time() < deadline, f"never served: {r.status} {body}")
    time.sleep(0.2)
expect(body == "8080-masked.example", f"Host seen: {body!r}")

for s in made:
    s.kill()
server.shutdown()
print("ALL OK", flush=True)
