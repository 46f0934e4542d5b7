//! A backend that counts what a store asks of it (a local directory underneath): each call
//! would be one request to S3 per object (a lookup is a `HEAD`, a ranged read one `GET`, a
//! listing one `LIST` page or more).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use torpor_snapshot::backend::{Backend, ObjectInfo, ObjectKey};
use torpor_snapshot::{BackendError, LocalBackend};

/// Requests by kind since the last [`Counting::take_each`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // each example reads the kinds it reports
pub struct Requests {
    pub lookups: u64,
    pub reads: u64,
    pub writes: u64,
    pub deletes: u64,
    pub lists: u64,
}

impl Requests {
    #[allow(dead_code)]
    pub fn total(&self) -> u64 {
        self.lookups + self.reads + self.writes + self.deletes + self.lists
    }
}

#[derive(Debug)]
pub struct Counting {
    inner: LocalBackend,
    lookups: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    deletes: AtomicU64,
    lists: AtomicU64,
}

impl Counting {
    pub fn open(root: &Path) -> Counting {
        Counting {
            inner: LocalBackend::open(root).unwrap(),
            lookups: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            deletes: AtomicU64::new(0),
            lists: AtomicU64::new(0),
        }
    }

    /// Lookups, reads (listings among them) and writes since the last take; deletes are not
    /// counted here.
    #[allow(dead_code)]
    pub fn take(&self) -> [u64; 3] {
        let r = self.take_each();
        [r.lookups, r.reads + r.lists, r.writes]
    }

    pub fn take_each(&self) -> Requests {
        let t = |c: &AtomicU64| c.swap(0, Ordering::SeqCst);
        Requests {
            lookups: t(&self.lookups),
            reads: t(&self.reads),
            writes: t(&self.writes),
            deletes: t(&self.deletes),
            lists: t(&self.lists),
        }
    }
}

fn count(c: &AtomicU64, n: usize) {
    c.fetch_add(n as u64, Ordering::SeqCst);
}

#[async_trait::async_trait]
impl Backend for Counting {
    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), BackendError> {
        count(&self.writes, 1);
        self.inner.put(key, data).await
    }
    async fn put_many(&self, objects: Vec<(ObjectKey, Bytes)>) -> Result<(), BackendError> {
        count(&self.writes, objects.len());
        self.inner.put_many(objects).await
    }
    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, BackendError> {
        count(&self.reads, 1);
        self.inner.get(key).await
    }
    async fn get_many(&self, keys: &[ObjectKey]) -> Result<Vec<Option<Bytes>>, BackendError> {
        count(&self.reads, keys.len());
        self.inner.get_many(keys).await
    }
    async fn get_ranges(
        &self,
        key: &ObjectKey,
        ranges: &[std::ops::Range<u64>],
    ) -> Result<Option<Vec<Bytes>>, BackendError> {
        count(&self.reads, 1);
        self.inner.get_ranges(key, ranges).await
    }
    async fn exists_many(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, BackendError> {
        count(&self.lookups, keys.len());
        self.inner.exists_many(keys).await
    }
    async fn delete(&self, key: &ObjectKey) -> Result<(), BackendError> {
        count(&self.deletes, 1);
        self.inner.delete(key).await
    }
    async fn delete_durably(&self, key: &ObjectKey) -> Result<(), BackendError> {
        count(&self.deletes, 1);
        self.inner.delete_durably(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        count(&self.lists, 1);
        self.inner.list(prefix).await
    }
}
