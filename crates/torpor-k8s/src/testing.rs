//! An in-memory Kubernetes API server behind a `kube::Client`, on kube-rs' `tower-test`
//! pattern (`tower_test::mock::pair`): the client's requests arrive on a handle, and a task
//! answers them from a map of objects the way the API server would for what the operator
//! uses: get, create, replace, delete (with finalizers: `deletionTimestamp` first, gone when
//! the last finalizer is removed), JSON and merge patches, and the status subresource (a
//! patch there changes only `status`; a patch of the object never does). Every request is
//! recorded (`METHOD path`) for assertions. No watch: tests call the reconcile functions
//! directly, as kube-rs' own controller tests do.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{json, Value};

/// The objects the fake holds, by path (`/apis/torpor.dev/v1alpha1/sandboxtemplates/py`,
/// `/api/v1/namespaces/torpor/secrets/torpor-tenant-a`).
#[derive(Clone, Default)]
pub struct FakeApiServer {
    objects: Arc<Mutex<BTreeMap<String, Value>>>,
    requests: Arc<Mutex<Vec<String>>>,
    version: Arc<Mutex<u64>>,
}

impl FakeApiServer {
    /// A client whose every request is answered by a new fake server (a task on the current
    /// runtime).
    pub fn start() -> (kube::Client, FakeApiServer) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let fake = FakeApiServer::default();
        let server = fake.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let (parts, body) = req.into_parts();
                let bytes = body.collect_bytes().await.unwrap_or_default();
                let (status, answer) =
                    server.answer(&parts.method, &parts.uri, &parts.headers, &bytes);
                let resp = Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&answer).unwrap_or_default()))
                    .expect("a response");
                send.send_response(resp);
            }
        });
        (kube::Client::new(service, "default"), fake)
    }

    /// Stores `obj` as `kubectl create` would (uid, resourceVersion, generation 1).
    pub fn insert(&self, path: &str, mut obj: Value) {
        self.stamp_new(&mut obj);
        self.objects.lock().unwrap().insert(path.to_string(), obj);
    }

    pub fn get(&self, path: &str) -> Option<Value> {
        self.objects.lock().unwrap().get(path).cloned()
    }

    /// Replaces the spec as `kubectl apply` would (generation + 1).
    pub fn set_spec(&self, path: &str, spec: Value) {
        let mut objects = self.objects.lock().unwrap();
        let obj = objects.get_mut(path).expect("the object exists");
        obj["spec"] = spec;
        let generation = obj["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
        obj["metadata"]["generation"] = generation.into();
        obj["metadata"]["resourceVersion"] = self.next_version().into();
    }

    /// `kubectl delete`: sets deletionTimestamp while finalizers remain, else removes it.
    pub fn delete(&self, path: &str) {
        let mut objects = self.objects.lock().unwrap();
        Self::delete_locked(&mut objects, path, &self.next_version());
    }

    /// Every request so far, as `METHOD /path`.
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    fn next_version(&self) -> String {
        let mut v = self.version.lock().unwrap();
        *v += 1;
        v.to_string()
    }

    fn stamp_new(&self, obj: &mut Value) {
        let version = self.next_version();
        let meta = &mut obj["metadata"];
        meta["uid"] = format!("uid-{version}").into();
        meta["resourceVersion"] = version.into();
        meta["generation"] = 1.into();
        meta["creationTimestamp"] = "2026-01-01T00:00:00Z".into();
    }

    fn delete_locked(
        objects: &mut BTreeMap<String, Value>,
        path: &str,
        version: &str,
    ) -> Option<Value> {
        let obj = objects.get_mut(path)?;
        let has_finalizers = obj["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if has_finalizers {
            obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:01Z".into();
            obj["metadata"]["resourceVersion"] = version.into();
            Some(obj.clone())
        } else {
            objects.remove(path)
        }
    }

    fn answer(
        &self,
        method: &http::Method,
        uri: &http::Uri,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> (StatusCode, Value) {
        let path = uri.path().to_string();
        self.requests
            .lock()
            .unwrap()
            .push(format!("{method} {path}"));
        let (object_path, subresource) = match path.strip_suffix("/status") {
            Some(p) => (p.to_string(), Some("status")),
            None => (path.clone(), None),
        };
        let mut objects = self.objects.lock().unwrap();
        let version = self.next_version();
        match method.as_str() {
            "GET" => match objects.get(&object_path) {
                Some(o) => (StatusCode::OK, o.clone()),
                None => not_found(&object_path),
            },
            "POST" => {
                let Ok(mut obj) = serde_json::from_slice::<Value>(body) else {
                    return bad_request("body is not JSON");
                };
                let Some(name) = obj["metadata"]["name"].as_str().map(str::to_string) else {
                    return bad_request("metadata.name is required");
                };
                let at = format!("{path}/{name}");
                if objects.contains_key(&at) {
                    return status(
                        StatusCode::CONFLICT,
                        "AlreadyExists",
                        &format!("{at} already exists"),
                    );
                }
                obj["metadata"]["uid"] = format!("uid-{version}").into();
                obj["metadata"]["resourceVersion"] = version.into();
                obj["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z".into();
                objects.insert(at, obj.clone());
                (StatusCode::CREATED, obj)
            }
            "PUT" => {
                let Ok(mut obj) = serde_json::from_slice::<Value>(body) else {
                    return bad_request("body is not JSON");
                };
                let Some(old) = objects.get(&object_path) else {
                    return not_found(&object_path);
                };
                if obj["metadata"]["resourceVersion"] != old["metadata"]["resourceVersion"] {
                    return status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        "the object has been modified",
                    );
                }
                obj["metadata"]["uid"] = old["metadata"]["uid"].clone();
                obj["metadata"]["resourceVersion"] = version.into();
                objects.insert(object_path, obj.clone());
                (StatusCode::OK, obj)
            }
            "DELETE" => match Self::delete_locked(&mut objects, &object_path, &version) {
                Some(o) => (StatusCode::OK, o),
                None => not_found(&object_path),
            },
            "PATCH" => {
                let Some(old) = objects.get(&object_path).cloned() else {
                    return not_found(&object_path);
                };
                let Ok(patch) = serde_json::from_slice::<Value>(body) else {
                    return bad_request("body is not JSON");
                };
                let kind = headers
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                let mut new = old.clone();
                match kind {
                    "application/json-patch+json" => {
                        // The API server's JSON patch reads a missing path as null in a `test`
                        // (kube's finalizer tests `/metadata/finalizers` for null that way).
                        let ops: Vec<Value> = patch
                            .as_array()
                            .cloned()
                            .unwrap_or_default()
                            .into_iter()
                            .filter(|op| {
                                !(op["op"] == "test"
                                    && op["value"].is_null()
                                    && op["path"]
                                        .as_str()
                                        .is_some_and(|p| new.pointer(p).is_none()))
                            })
                            .collect();
                        let Ok(p) = serde_json::from_value::<json_patch::Patch>(Value::Array(ops))
                        else {
                            return bad_request("not a JSON patch");
                        };
                        if json_patch::patch(&mut new, &p).is_err() {
                            // A failed `test` operation: the object changed meanwhile.
                            return status(
                                StatusCode::UNPROCESSABLE_ENTITY,
                                "Invalid",
                                "the JSON patch does not apply",
                            );
                        }
                    }
                    "application/merge-patch+json" => json_patch::merge(&mut new, &patch),
                    other => {
                        return bad_request(&format!(
                            "patch type {other:?} is not served by the fake"
                        ))
                    }
                }
                // The status subresource changes only status; the object never changes it.
                match subresource {
                    Some(_) => {
                        let s = new["status"].take();
                        new = old.clone();
                        new["status"] = s;
                    }
                    None => new["status"] = old["status"].clone(),
                }
                if new["status"].is_null() {
                    if let Some(o) = new.as_object_mut() {
                        o.remove("status");
                    }
                }
                new["metadata"]["resourceVersion"] = version.into();
                let deleting = !new["metadata"]["deletionTimestamp"].is_null();
                let finalizers_left = new["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty());
                if deleting && !finalizers_left {
                    objects.remove(&object_path);
                } else {
                    objects.insert(object_path, new.clone());
                }
                (StatusCode::OK, new)
            }
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not served by the fake",
            ),
        }
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> (StatusCode, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

fn not_found(path: &str) -> (StatusCode, Value) {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{path} not found"),
    )
}

fn bad_request(message: &str) -> (StatusCode, Value) {
    status(StatusCode::BAD_REQUEST, "BadRequest", message)
}

/// Paths of the objects the operator reads and writes.
pub mod paths {
    pub fn template(name: &str) -> String {
        format!("/apis/torpor.dev/v1alpha1/sandboxtemplates/{name}")
    }
    pub fn tenant(name: &str) -> String {
        format!("/apis/torpor.dev/v1alpha1/tenantquotas/{name}")
    }
    pub fn pool(name: &str) -> String {
        format!("/apis/torpor.dev/v1alpha1/workerpools/{name}")
    }
    pub fn secret(namespace: &str, name: &str) -> String {
        format!("/api/v1/namespaces/{namespace}/secrets/{name}")
    }
}
