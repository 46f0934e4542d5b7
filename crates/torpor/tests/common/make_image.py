# Builds a tiny image for the tests: /bin/sh (the host's dash) with the libraries it loads and
# /app/hello.txt ("hi from image"); config: env GREETING=from-image, PATH=/bin, working dir /app,
# ref name "tiny". Usage: make_image.py OUT [FLAG...]
#   hostile  also a setuid /bin/su, a setgid /bin/wall, /dev/mem and /dev/sda (what would give a
#            local user root if it reached the host's disk as it is)
#   rootfs   write the root filesystem as a plain tarball instead of an oci-archive
#   escape   (with rootfs) entries that try to leave the root: a symlink to /tmp with a file
#            under it, and a ../../../tmp path
import hashlib, io, json, os, subprocess, sys, tarfile
out, flags = sys.argv[1], set(sys.argv[2:])
def add_file(tar, host, inside):
    tar.add(os.path.realpath(host), arcname=inside.lstrip("/"))
def add_bytes(tar, name, data, mode=0o644):
    info = tarfile.TarInfo(name); info.size = len(data); info.mode = mode; info.uid = 0
    tar.addfile(info, io.BytesIO(data))
layer = io.BytesIO()
with tarfile.open(fileobj=layer, mode="w") as t:
    add_file(t, "/bin/dash", "/bin/sh")
    for line in subprocess.run(["ldd", "/bin/dash"], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            add_file(t, path, path)
    add_bytes(t, "app/hello.txt", b"hi from image\n")
    if "hostile" in flags:
        dash = open(os.path.realpath("/bin/dash"), "rb").read()
        add_bytes(t, "bin/su", dash, 0o4755)
        add_bytes(t, "bin/wall", dash, 0o2755)
        for name, kind, major, minor in (("dev/mem", tarfile.CHRTYPE, 1, 1), ("dev/sda", tarfile.BLKTYPE, 8, 0)):
            info = tarfile.TarInfo(name); info.type = kind; info.devmajor = major; info.devminor = minor
            info.mode = 0o666; t.addfile(info)
    if "escape" in flags:
        link = tarfile.TarInfo("escape"); link.type = tarfile.SYMTYPE; link.linkname = "/tmp"
        t.addfile(link)
        add_bytes(t, "escape/torpor-evil-marker", b"written outside\n")
        add_bytes(t, "../../../tmp/torpor-evil-marker2", b"written outside\n")
layer = layer.getvalue()
if "rootfs" in flags:
    open(out, "wb").write(layer)
    sys.exit(0)
def blob(b): return "sha256:" + hashlib.sha256(b).hexdigest()
config = json.dumps({"architecture": "amd64", "os": "linux",
    "config": {"Env": ["GREETING=from-image", "PATH=/bin"], "WorkingDir": "/app"},
    "rootfs": {"type": "layers", "diff_ids": [blob(layer)]}}).encode()
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config), "size": len(config)},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": blob(layer), "size": len(layer)}]}).encode()
index = json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
    "digest": blob(manifest), "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "tiny"}}]}).encode()
with tarfile.open(out, "w") as t:
    def put(name, b):
        info = tarfile.TarInfo(name); info.size = len(b); t.addfile(info, io.BytesIO(b))
    put("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
    put("index.json", index)
    for b in (layer, config, manifest):
        put("blobs/sha256/" + blob(b)[7:], b)
