"""HTTPS as E2B's SDK builds it: the official, unmodified e2b Python SDK, told only E2B_DOMAIN
and E2B_API_KEY, reaches torpor's --tls-listen: the control plane at https://api.{domain}, envd
at https://49983-{id}.{domain} (commands.run, files, is_running) and a server in the sandbox at
https://{sbx.get_host(port)}, each certificate verified against the test CA.

Environment: E2B_API_KEY, E2B_DOMAIN (the daemon's --proxy-domain), SSL_CERT_FILE (the test
CA, which the SDK's TLS stack loads as the system's trust store), TORPOR_TLS_ADDR (host:port of
the HTTPS listener). No E2B_API_URL, E2B_SANDBOX_URL or E2B_DEBUG: every URL is the SDK's own.

The names under E2B_DOMAIN resolve nowhere, and the SDK's URLs name port 443. The script's own
CONNECT tunnel, handed to the SDK as its documented `proxy` option, is the resolver: it sends
every `*.{domain}:443` to TORPOR_TLS_ADDR and refuses anything else. TLS runs end to end
through it: the SDK checks torpor's certificate against the very name it built.
"""
import http.client
import os
import socket
import ssl
import threading
import time

from e2b import Sandbox

DOMAIN = os.environ["E2B_DOMAIN"]
TLS_HOST, TLS_PORT = os.environ["TORPOR_TLS_ADDR"].rsplit(":", 1)
CA = os.environ["SSL_CERT_FILE"]


def step(name):
    print(f"step: {name}", flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


class Tunnel:
    """An HTTP CONNECT proxy that resolves `*.{DOMAIN}:443` to torpor's HTTPS listener."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.hosts = set()
        self.refused = []
        threading.Thread(target=self.accept, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def accept(self):
        while True:
            c, _ = self.sock.accept()
            threading.Thread(target=self.handle, args=(c,), daemon=True).start()

    def handle(self, c):
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = c.recv(4096)
            if not d:
                c.close()
                return
            buf += d
        head, rest = buf.split(b"\r\n\r\n", 1)
        method, authority, _ = head.split(b"\r\n")[0].decode().split(" ", 2)
        host, port = authority.rsplit(":", 1)
        if method != "CONNECT" or port != "443" or not host.endswith("." + DOMAIN):
            self.refused.append(authority)
            c.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            c.close()
            return
        self.hosts.add(host)
        u = socket.create_connection((TLS_HOST, int(TLS_PORT)))
        c.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            u.sendall(rest)
        threading.Thread(target=pipe, args=(u, c), daemon=True).start()
        pipe(c, u)


def pipe(src, dst):
    try:
        while True:
            d = src.recv(65536)
            if not d:
                break
            dst.sendall(d)
    except OSError:
        pass
    for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
        try:
            s.shutdown(how)
        except OSError:
            pass


tunnel = Tunnel()
PROXY = tunnel.url


def https_get(host, path):
    """GET https://{host}{path} through the tunnel, verifying the certificate for `host`."""
    ctx = ssl.create_default_context(cafile=CA)
    conn = http.client.HTTPSConnection("127.0.0.1", tunnel.port, context=ctx, timeout=120)
    conn.set_tunnel(host, 443)
    conn.request("GET", path)
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    conn.close()
    return r.status, body


step("create through https://api.<domain>")
sbx = Sandbox.create(timeout=600, proxy=PROXY)
sid = sbx.sandbox_id
expect(sbx.sandbox_domain == DOMAIN, f"sandbox domain {sbx.sandbox_domain!r}")
expect(
    sbx.envd_api_url == f"https://49983-{sid}.{DOMAIN}",
    f"the SDK's own envd URL: {sbx.envd_api_url}",
)

step("commands.run through envd at https://49983-<id>.<domain>")
r = sbx.commands.run("echo hello-over-tls && id -un")
expect(r.exit_code == 0, f"exit {r.exit_code}: {r.stderr}")
expect(r.stdout.split() == ["hello-over-tls", "user"], f"stdout {r.stdout!r}")
expect(sbx.is_running(), "is_running over https")

step("files through envd over https")
sbx.files.write("/home/user/tls.txt", "written-over-tls")
expect(sbx.files.read("/home/user/tls.txt") == "written-over-tls", "read back")
expect(
    any(e.name == "tls.txt" for e in sbx.files.list("/home/user")),
    "listed",
)

step("a server in the sandbox at https://<get_host(port)>")
sbx.commands.run(
    "cd /tmp && echo served-over-tls > hello.txt && "
    "exec python3 -m http.server -p HTTP/1.1 8080",
    background=True,
)
host = sbx.get_host(8080)
expect(host == f"8080-{sid}.{DOMAIN}", f"get_host: {host}")
deadline = time.time() + 60
while True:
    status, body = https_get(host, "/hello.txt")
    if status == 200:
        break
    expect(time.time() < deadline, f"never served: {status} {body}")
    time.sleep(0.2)
expect(body.strip() == "served-over-tls", f"body {body!r}")

step("connect again, then run")
again = Sandbox.connect(sid, proxy=PROXY)
expect(again.commands.run("cat /tmp/hello.txt").stdout.strip() == "served-over-tls", "connect")

step("every request went to the names the SDK built")
for name in (f"api.{DOMAIN}", f"49983-{sid}.{DOMAIN}", f"8080-{sid}.{DOMAIN}"):
    expect(name in tunnel.hosts, f"{name} not among {sorted(tunnel.hosts)}")
expect(not tunnel.refused, f"requests outside the domain: {tunnel.refused}")

sbx.kill()
print("ALL OK", flush=True)
