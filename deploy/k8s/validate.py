#!/usr/bin/env python3
"""Validates deploy/k8s without a cluster, kustomize or kubectl.

Renders every kustomization under deploy/k8s the way `kubectl apply -k` would for the features
they use (resources, nested kustomizations, namespace, labels, inline JSON 6902 patches,
configMapGenerator without name hashes; anything else is refused, so nothing is silently
skipped), then checks:

- every built-in object against the Kubernetes OpenAPI schemas (PyPI `kubernetes-validate`,
  strict: unknown fields are errors);
- every torpor.dev object (the examples) against the CRDs' own schemas from crds.yaml, and the
  CRDs' schemas are structural (every node typed), as the API server demands;
- references inside each rendering: Services select some pod template and name its ports,
  probes name declared ports, Secrets and ConfigMaps a workload needs exist (in the base: or
  are listed as expected from outside);
- the controller and worker commands carry the contract's flags (issue 16), so the manifests
  cannot drift from the binary's interface unnoticed;
- every YAML file under deploy/k8s is part of some kustomization or validated on its own.

Objects of third-party CRDs (cert-manager, Prometheus Operator, KEDA) are checked for shape only
(apiVersion, kind, metadata.name, spec): their schemas are not available offline.
"""

import copy
import json
import os
import sys

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSION = "1.33.0"
ROOT = os.path.dirname(os.path.abspath(__file__))

CLUSTER_SCOPED = {
    "Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
    "PersistentVolume", "StorageClass", "PriorityClass", "SandboxTemplate", "TenantQuota",
    "WorkerPool", "ClusterIssuer",
}
THIRD_PARTY_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/", "keda.sh/")

# What the base needs from outside (its kustomization.yaml says so).
BASE_EXPECTS = {
    ("Secret", "torpor-admin-token"), ("Secret", "torpor-env-key"), ("Secret", "torpor-postgres"),
    ("Secret", "torpor-s3"),
}

# The contract of issue 16: flags each role's command must carry.
CONTRACT = {
    "torpor-controller": ["controller", "--database", "--store", "--listen", "--cluster-listen",
                          "--tls-dir", "--admin-token-file"],
    "torpor-worker": ["worker", "--controller", "--tls-dir", "--data-dir", "--name"],
}
CONTRACT_VALUES = {
    "torpor-controller": {"--listen": "0.0.0.0:8080", "--cluster-listen": "0.0.0.0:7443",
                          "--peer-listen": "0.0.0.0:7445",
                          "--tls-dir": "/etc/torpor/tls",
                          "--admin-token-file": "/etc/torpor/admin/token"},
    "torpor-worker": {"--controller": "torpor-controller-cluster:7443",
                      "--tls-dir": "/etc/torpor/tls", "--data-dir": "/var/lib/torpor",
                      "--name": "$(NODE_NAME)"},
}

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "labels",
                      "configMapGenerator", "generatorOptions"}

errors = []


def error(where, msg):
    errors.append(f"{where}: {msg}")


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def json_patch(doc, ops, where):
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(idx, op["value"])
            elif kind == "replace":
                parent[idx] = op["value"]
            elif kind == "remove":
                del parent[idx]
            else:
                error(where, f"patch op {kind!r} is not supported by this renderer")
        else:
            if kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    error(where, f"patch replaces {op['path']}, which does not exist")
                parent[last] = op["value"]
            elif kind == "remove":
                if last not in parent:
                    error(where, f"patch removes {op['path']}, which does not exist")
                else:
                    del parent[last]
            else:
                error(where, f"patch op {kind!r} is not supported by this renderer")


def render(directory, seen_files):
    """The objects `kubectl apply -k directory` would send."""
    kpath = os.path.join(directory, "kustomization.yaml")
    where = os.path.relpath(kpath, ROOT)
    seen_files.add(os.path.abspath(kpath))
    k = load_docs(kpath)[0]
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        error(where, f"fields this renderer does not implement: {sorted(unknown)}")
    if k.get("kind") != "Kustomization":
        error(where, "kind must be Kustomization")
    objs = []
    for r in k.get("resources", []):
        p = os.path.normpath(os.path.join(directory, r))
        if os.path.isdir(p):
            objs.extend(render(p, seen_files))
        elif os.path.isfile(p):
            seen_files.add(os.path.abspath(p))
            objs.extend((d, os.path.relpath(p, ROOT)) for d in load_docs(p))
        else:
            error(where, f"resource {r} does not exist")
    hashed = not k.get("generatorOptions", {}).get("disableNameSuffixHash", False)
    for g in k.get("configMapGenerator", []):
        if hashed:
            error(where, "configMapGenerator with name hashes is not implemented by this renderer")
        data = {}
        for f in g.get("files", []):
            key, _, src = f.partition("=") if "=" in f else (os.path.basename(f), "", f)
            path = os.path.join(directory, src)
            seen_files.add(os.path.abspath(path))
            with open(path) as fh:
                data[key] = fh.read()
        for lit in g.get("literals", []):
            key, _, val = lit.partition("=")
            data[key] = val
        meta = {"name": g["name"]}
        if "namespace" in g:
            meta["namespace"] = g["namespace"]
        objs.append(({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}, where))
    for p in k.get("patches", []):
        t = p.get("target", {})
        if "patch" not in p or not isinstance(yaml.safe_load(p["patch"]), list):
            error(where, "only inline JSON 6902 patches are implemented by this renderer")
            continue
        ops = yaml.safe_load(p["patch"])
        hits = [o for o, _ in objs
                if o.get("kind") == t.get("kind") and o["metadata"].get("name") == t.get("name")]
        if len(hits) != 1:
            error(where, f"patch target {t} matches {len(hits)} objects, not 1")
        for o in hits:
            json_patch(o, ops, where)
    for lab in k.get("labels", []):
        if lab.get("includeSelectors") or lab.get("includeTemplates"):
            error(where, "labels with includeSelectors/includeTemplates are not implemented")
        for o, _ in objs:
            o["metadata"].setdefault("labels", {}).update(lab["pairs"])
    ns = k.get("namespace")
    if ns:
        for o, _ in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = ns
    return objs


def structural(schema, path, where):
    """The API server's structural-schema rule: every node has a type."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-int-or-string"):
        return
    if "type" not in schema:
        error(where, f"schema node {path} has no type (not structural)")
    for k in ("oneOf", "anyOf", "allOf"):
        for i, sub in enumerate(schema.get(k, [])):
            for key in ("type", "default", "nullable", "description"):
                if key in sub:
                    error(where, f"{path}.{k}[{i}] sets {key} (not allowed in a structural schema)")
    for name, sub in schema.get("properties", {}).items():
        structural(sub, f"{path}.{name}", where)
    if isinstance(schema.get("items"), dict):
        structural(schema["items"], f"{path}[]", where)
    if isinstance(schema.get("additionalProperties"), dict):
        structural(schema["additionalProperties"], f"{path}{{}}", where)


def to_jsonschema(s):
    """OpenAPI v3's `nullable` as JSON Schema, and unknown fields refused (the API server
    prunes them from a structural schema, and kubectl's strict field validation refuses them)."""
    s = copy.deepcopy(s)
    def walk(n):
        if isinstance(n, dict):
            if "properties" in n and "additionalProperties" not in n \
                    and not n.get("x-kubernetes-preserve-unknown-fields"):
                n["additionalProperties"] = False
            if n.pop("nullable", False) and "type" in n:
                n["type"] = [n["type"], "null"]
                if "enum" in n:
                    n["enum"] = list(n["enum"]) + [None]
            for v in n.values():
                walk(v)
        elif isinstance(n, list):
            for v in n:
                walk(v)
    walk(s)
    return s


def crd_schemas():
    out = {}
    for crd in load_docs(os.path.join(ROOT, "base", "crds.yaml")):
        where = f"base/crds.yaml {crd['metadata']['name']}"
        for v in crd["spec"]["versions"]:
            schema = v["schema"]["openAPIV3Schema"]
            structural(schema, crd["spec"]["names"]["kind"], where)
            out[(f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])] = schema
    return out


def validate_object(obj, where, schemas):
    api, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    name = obj.get("metadata", {}).get("name")
    label = f"{where} {kind}/{name}"
    if not name:
        error(label, "metadata.name is missing")
    if (api, kind) in schemas:
        if kind in CLUSTER_SCOPED and "namespace" in obj["metadata"]:
            error(label, "a cluster-scoped object has a namespace")
        try:
            jsonschema.validate(obj, {
                "type": "object",
                "properties": {"spec": to_jsonschema(schemas[(api, kind)])["properties"]["spec"]},
            })
        except jsonschema.ValidationError as e:
            error(label, f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}")
        return "crd"
    if api.startswith(THIRD_PARTY_GROUPS):
        if not isinstance(obj.get("spec"), dict):
            error(label, "no spec")
        return "third-party"
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        error(label, f"{'.'.join(str(p) for p in e.path)}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError:
        error(label, f"no Kubernetes {K8S_VERSION} schema for {api} {kind}")
    return "builtin"


def pod_templates(objs):
    for o, where in objs:
        spec = o.get("spec", {})
        if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            yield o, where, spec["template"]
        elif o["kind"] == "Pod":
            yield o, where, o


def check_references(objs, name, expects):
    defined = {(o["kind"], o["metadata"]["name"]) for o, _ in objs}
    # cert-manager makes the Secret a Certificate names.
    defined |= {("Secret", o["spec"]["secretName"]) for o, _ in objs
                if o["kind"] == "Certificate" and "secretName" in o.get("spec", {})}
    defined |= expects
    pods = list(pod_templates(objs))
    for o, where, tpl in pods:
        label = f"{name}: {where} {o['kind']}/{o['metadata']['name']}"
        spec = tpl["spec"]
        needed = set()
        for v in spec.get("volumes", []):
            if "secret" in v:
                needed.add(("Secret", v["secret"]["secretName"]))
            if "configMap" in v:
                needed.add(("ConfigMap", v["configMap"]["name"]))
            for src in v.get("projected", {}).get("sources", []):
                if "secret" in src:
                    needed.add(("Secret", src["secret"]["name"]))
        mounts = {v["name"] for v in spec.get("volumes", [])}
        mounts |= {c["metadata"]["name"] for c in o.get("spec", {}).get("volumeClaimTemplates", [])}
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for m in c.get("volumeMounts", []):
                if m["name"] not in mounts:
                    error(label, f"container {c['name']} mounts undeclared volume {m['name']}")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    needed.add(("Secret", ref["secretKeyRef"]["name"]))
                if "configMapKeyRef" in ref:
                    needed.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
            for e in c.get("envFrom", []):
                if "secretRef" in e:
                    needed.add(("Secret", e["secretRef"]["name"]))
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                pr = c.get(probe, {})
                for h in ("httpGet", "tcpSocket", "grpc"):
                    port = pr.get(h, {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        error(label, f"{c['name']} {probe} names port {port!r}, not declared")
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in defined:
            error(label, f"service account {sa} is not defined")
        for n in sorted(needed - defined):
            error(label, f"needs {n[0]} {n[1]}, which this rendering does not make")
    for o, where in objs:
        if o["kind"] != "Service" or "selector" not in o["spec"]:
            continue
        sel = o["spec"]["selector"]
        label = f"{name}: {where} Service/{o['metadata']['name']}"
        matches = [t for p, _, t in pods
                   if all(t.get("metadata", {}).get("labels", {}).get(k) == v for k, v in sel.items())
                   and p["metadata"].get("namespace") == o["metadata"].get("namespace")]
        if not matches:
            error(label, f"selector {sel} matches no pod template")
            continue
        for port in o["spec"].get("ports", []):
            tp = port.get("targetPort")
            if isinstance(tp, str):
                names = {p.get("name") for t in matches for c in t["spec"]["containers"]
                         for p in c.get("ports", [])}
                if tp not in names:
                    error(label, f"targetPort {tp!r} is no port of the pods it selects")


def check_contract(objs, name):
    for o, where in objs:
        role = o["metadata"]["name"]
        if role not in CONTRACT or o["kind"] not in ("Deployment", "DaemonSet"):
            continue
        cmd = o["spec"]["template"]["spec"]["containers"][0]["command"]
        for flag in CONTRACT[role]:
            if flag not in cmd:
                error(f"{name}: {role}", f"command lacks {flag} (issue 16's contract)")
        for flag, value in CONTRACT_VALUES[role].items():
            if flag in cmd and cmd[cmd.index(flag) + 1] != value:
                error(f"{name}: {role}", f"{flag} is {cmd[cmd.index(flag) + 1]!r}, not {value!r}")


def check_controller_identity(objs, name):
    """Controllers of one database must not share a name (each holds its own sandboxes and its
    own containers on the workers): with more than one replica, the controller's TLS identity
    must be per pod (cert-manager's csi-driver, ${POD_NAME} in the URI SAN)."""
    for o, _ in objs:
        if o["kind"] != "Deployment" or o["metadata"]["name"] != "torpor-controller":
            continue
        spec = o["spec"]["template"]["spec"]
        tls = next((v for v in spec.get("volumes", []) if v["name"] == "tls"), {})
        uri = tls.get("csi", {}).get("volumeAttributes", {}).get("csi.cert-manager.io/uri-sans", "")
        if o["spec"].get("replicas", 1) > 1 and "${POD_NAME}" not in uri:
            error(f"{name}: torpor-controller",
                  "its replicas share one controller identity: the tls volume must give each "
                  "pod its own (csi.cert-manager.io, ${POD_NAME} in uri-sans)")


def self_test(schemas):
    """Each kind of mistake the checks exist for, made on purpose, must be reported."""
    seen = set()
    base = render(os.path.join(ROOT, "base"), seen)
    dev = render(os.path.join(ROOT, "examples", "dev"), seen)
    res = render(os.path.join(ROOT, "examples", "resources"), seen)
    def find(objs, kind, name):
        return next(o for o, _ in objs if o["kind"] == kind and o["metadata"]["name"] == name)
    cases = []
    def case(label, objs, mutate, check):
        objs = copy.deepcopy(objs)
        mutate(objs)
        before = len(errors)
        check(objs)
        caught = len(errors) > before
        del errors[before:]
        cases.append((label, caught))
    def validate_all(objs):
        for o, w in objs:
            validate_object(o, w, schemas)
    case("an unknown field in a Deployment", base,
         lambda o: find(o, "Deployment", "torpor-controller")["spec"].update(replica=3), validate_all)
    case("a wrong type in a DaemonSet", base,
         lambda o: find(o, "DaemonSet", "torpor-worker")["spec"]["template"]["spec"].update(
             terminationGracePeriodSeconds="long"), validate_all)
    case("an unknown field in a SandboxTemplate", res,
         lambda o: find(o, "SandboxTemplate", "py")["spec"].update(image="x"), validate_all)
    case("a bad enum in a WorkerPool trigger", res,
         lambda o: find(o, "WorkerPool", "team-a-jobs")["spec"]["triggers"][0].update(type="sqs"),
         validate_all)
    case("a Service selecting no pod", base,
         lambda o: find(o, "Service", "torpor-api")["spec"]["selector"].update(tier="x"),
         lambda o: check_references(o, "self-test", BASE_EXPECTS))
    case("a probe naming an undeclared port", base,
         lambda o: find(o, "Deployment", "torpor-operator")["spec"]["template"]["spec"]["containers"][0]
         ["readinessProbe"]["httpGet"].update(port="nope"),
         lambda o: check_references(o, "self-test", BASE_EXPECTS))
    case("a Secret nobody makes", dev,
         lambda o: [x for x in o if not (x[0]["kind"] == "Secret" and x[0]["metadata"]["name"] == "torpor-s3")]
         and o.remove(next(x for x in o if x[0]["kind"] == "Secret" and x[0]["metadata"]["name"] == "torpor-s3")),
         lambda o: check_references(o, "self-test", set()))
    case("replicas sharing one controller identity", base,
         lambda o: [v.pop("csi") and v.update(secret={"secretName": "torpor-controller-tls"})
                    for v in find(o, "Deployment", "torpor-controller")["spec"]["template"]["spec"]
                    ["volumes"] if v["name"] == "tls"],
         lambda o: check_controller_identity(o, "self-test"))
    case("a contract flag missing", base,
         lambda o: find(o, "Deployment", "torpor-controller")["spec"]["template"]["spec"]["containers"][0]
         ["command"].remove("--cluster-listen"),
         lambda o: check_contract(o, "self-test"))
    failed = [label for label, caught in cases if not caught]
    for label in failed:
        error("self-test", f"{label} was not caught")
    print(f"validate: self-test: {len(cases) - len(failed)}/{len(cases)} planted mistakes caught")


def main():
    schemas = crd_schemas()
    self_test(schemas)
    seen = set()
    counts = {"builtin": 0, "crd": 0, "third-party": 0}
    kustomizations = sorted(
        d for d, _, files in os.walk(ROOT) if "kustomization.yaml" in files)
    for d in kustomizations:
        name = os.path.relpath(d, ROOT)
        objs = render(d, seen)
        keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o, _ in objs]
        for key in {k for k in keys if keys.count(k) > 1}:
            error(name, f"{key} is rendered twice")
        for o, where in objs:
            counts[validate_object(o, f"{name}: {where}", schemas)] += 1
        check_references(objs, name, BASE_EXPECTS if name == "base" else
                         (BASE_EXPECTS if name in ("examples/keda", "examples/durable-audit") else set()) |
                         ({("Secret", "torpor-ca")} if name == "examples/cert-manager" else set()))
        check_contract(objs, name)
        check_controller_identity(objs, name)
        print(f"validate: {name}: {len(objs)} objects")
    # Files in no kustomization: examples applied one by one (e.g. the GPU pods).
    for d, _, files in os.walk(ROOT):
        for f in sorted(files):
            p = os.path.abspath(os.path.join(d, f))
            if not f.endswith((".yaml", ".yml")) or p in seen:
                continue
            rel = os.path.relpath(p, ROOT)
            for o in load_docs(p):
                counts[validate_object(o, rel, schemas)] += 1
            print(f"validate: {rel}: on its own")
    print(f"validate: {counts['builtin']} objects against the Kubernetes {K8S_VERSION} schemas, "
          f"{counts['crd']} against the torpor.dev CRDs, {counts['third-party']} third-party "
          f"objects by shape only")
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        print(f"validate: {len(errors)} errors", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
