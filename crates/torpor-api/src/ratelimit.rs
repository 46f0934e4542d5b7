//! Per-tenant rate limits and the edge's other bounds (concurrent file uploads).
//!
//! A token bucket per (tenant, [`RouteClass`]): it refills at the tenant's `requests_per_s`
//! (its quota, else the daemon's `--default-requests-per-s`; 0 means not limited) and holds up
//! to twice that (the burst). The admin token is never limited. A request over the rate is
//! answered `429 rate_limited` with `Retry-After`; every response of a limited class carries the
//! IETF `RateLimit-Limit` (the bucket's size), `RateLimit-Remaining` (whole tokens left) and
//! `RateLimit-Reset` (seconds until the bucket is full again), put there by
//! crate::request_id.
//!
//! What the limiter needs of the daemon (its buckets, the tenants' rates) it reads through
//! [`Rates`], so that it does not depend on the API's state.
//!
//! Buckets work on an explicit clock ([`Bucket::take_at`]) so that they are tested without
//! sleeping. Tenants' rates are read from the engine and cached for [`RATE_CACHE`].
//!
//! File uploads ([`UploadSlots`]) hold their body in memory (and the agent frame a copy of it):
//! each takes its weight in MiB (twice its size) from a per-tenant and a daemon-wide budget
//! before its body is read, and is refused while either is spent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use torpor_control::error::ErrorKind;
use torpor_control::ControlError;
use torpor_core::TenantId;

use crate::errors::ApiError;

/// What the limiter reads of the daemon.
pub trait Rates {
    /// The buckets and upload budgets.
    fn limits(&self) -> &EdgeLimits;
    /// Every tenant's `requests_per_s` quota (None: the default).
    fn tenant_rates(&self) -> Result<Vec<(TenantId, Option<u64>)>, ControlError>;
    /// The rate of tenants whose quotas name none (0: not limited).
    fn default_rate(&self) -> u64;
}

impl<T: Rates + ?Sized> Rates for Arc<T> {
    fn limits(&self) -> &EdgeLimits {
        (**self).limits()
    }
    fn tenant_rates(&self) -> Result<Vec<(TenantId, Option<u64>)>, ControlError> {
        (**self).tenant_rates()
    }
    fn default_rate(&self) -> u64 {
        (**self).default_rate()
    }
}

/// How long a tenant's `requests_per_s` is cached.
pub const RATE_CACHE: Duration = Duration::from_secs(2);
/// Buckets kept before full (idle) ones are dropped.
const MAX_BUCKETS: usize = 10_000;

/// What a request costs, for its bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteClass {
    /// Create, delete, suspend, resume, fork, lists and gets; templates, pools, tenants.
    Lifecycle,
    /// Exec, and E2B's process service.
    Exec,
    /// Files: v1 `/files`, E2B's filesystem service and `/files`.
    Files,
    /// Proxied requests to a sandbox's ports (path or host routing).
    Proxy,
}

impl RouteClass {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteClass::Lifecycle => "lifecycle",
            RouteClass::Exec => "exec",
            RouteClass::Files => "files",
            RouteClass::Proxy => "proxy",
        }
    }

    /// The class [`RouteClass::as_str`] names.
    pub fn parse(s: &str) -> Option<RouteClass> {
        [
            RouteClass::Lifecycle,
            RouteClass::Exec,
            RouteClass::Files,
            RouteClass::Proxy,
        ]
        .into_iter()
        .find(|c| c.as_str() == s)
    }

    /// The class of a v1 route, from its path below `/v1`.
    pub fn of_v1_path(path: &str) -> RouteClass {
        let path = path.strip_prefix("/v1").unwrap_or(path);
        let mut parts = path.trim_start_matches('/').split('/');
        match (parts.next(), parts.next(), parts.next()) {
            (Some("sandboxes"), Some(_), Some("exec")) => RouteClass::Exec,
            (Some("sandboxes"), Some(_), Some("files")) => RouteClass::Files,
            (Some("sandboxes"), Some(_), Some("ports")) => RouteClass::Proxy,
            _ => RouteClass::Lifecycle,
        }
    }
}

/// The rate-limit state of one request: what its headers say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// The bucket's size (the burst).
    pub limit: u64,
    /// Whole tokens left after this request.
    pub remaining: u64,
    /// Seconds until the bucket is full again.
    pub reset_s: u64,
    /// Seconds until a refused request would be let through (at least 1).
    pub retry_after_s: u64,
}

impl Decision {
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`, and `Retry-After` when
    /// refused.
    pub fn write_headers(&self, h: &mut HeaderMap) {
        h.insert("ratelimit-limit", HeaderValue::from(self.limit));
        h.insert("ratelimit-remaining", HeaderValue::from(self.remaining));
        h.insert("ratelimit-reset", HeaderValue::from(self.reset_s));
        if !self.allowed {
            h.insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(self.retry_after_s),
            );
        }
    }
}

/// A token bucket: `rate` tokens a second, at most `2 * rate`.
#[derive(Debug, Clone)]
pub struct Bucket {
    tokens: f64,
    /// When `tokens` was computed, on the limiter's clock.
    at: Duration,
}

impl Bucket {
    /// A full bucket at `now`.
    pub fn full(rate: u64, now: Duration) -> Bucket {
        Bucket {
            tokens: burst(rate) as f64,
            at: now,
        }
    }

    /// Takes one token at `now` (a clock that never goes back) for a bucket of `rate`.
    pub fn take_at(&mut self, rate: u64, now: Duration) -> Decision {
        let cap = burst(rate) as f64;
        let r = rate.max(1) as f64;
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * r).min(cap);
        self.at = now.max(self.at);
        let allowed = self.tokens >= 1.0;
        if allowed {
            self.tokens -= 1.0;
        }
        let secs = |missing: f64| (missing / r).ceil().max(0.0) as u64;
        Decision {
            allowed,
            limit: cap as u64,
            remaining: self.tokens.floor().max(0.0) as u64,
            reset_s: secs(cap - self.tokens),
            retry_after_s: secs(1.0 - self.tokens).max(1),
        }
    }

    /// Takes `n` tokens at `now` that were spent elsewhere (another controller let `n` of the
    /// tenant's requests through). The bucket may go below empty, at most by its size, so the
    /// tenant waits for what it spent; it never gets more than its rate in all.
    pub fn debit_at(&mut self, rate: u64, n: u64, now: Duration) {
        let cap = burst(rate) as f64;
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate.max(1) as f64).min(cap);
        self.at = now.max(self.at);
        self.tokens = (self.tokens - n as f64).max(-cap);
    }

    /// Whether the bucket is full at `now` (it can be forgotten).
    fn is_full(&self, rate: u64, now: Duration) -> bool {
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.tokens + elapsed * rate.max(1) as f64 >= burst(rate) as f64
    }
}

/// The bucket size for a rate: twice the rate (at least 1).
pub fn burst(rate: u64) -> u64 {
    rate.saturating_mul(2).max(1)
}

#[derive(Default)]
struct RateCache {
    rates: HashMap<TenantId, Option<u64>>,
    fetched: Option<Instant>,
}

/// The buckets of every (tenant, class).
pub struct RateLimiter {
    start: Instant,
    buckets: Mutex<HashMap<(TenantId, RouteClass), Bucket>>,
    cache: Mutex<RateCache>,
    /// Cluster mode (crate::rate_share): requests let through since the last report to the
    /// other controllers; `None` while nothing is shared.
    unreported: Mutex<Option<HashMap<(TenantId, RouteClass), u64>>>,
}

impl Default for RateLimiter {
    fn default() -> Self {
        RateLimiter {
            start: Instant::now(),
            buckets: Mutex::default(),
            cache: Mutex::default(),
            unreported: Mutex::default(),
        }
    }
}

impl RateLimiter {
    /// Takes a token for `tenant`'s `class` at `now` (the limiter's clock) from a bucket of
    /// `rate`.
    pub fn take_at(
        &self,
        tenant: &TenantId,
        class: RouteClass,
        rate: u64,
        now: Duration,
    ) -> Decision {
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if b.len() >= MAX_BUCKETS {
            b.retain(|_, bucket| !bucket.is_full(rate, now));
        }
        b.entry((tenant.clone(), class))
            .or_insert_with(|| Bucket::full(rate, now))
            .take_at(rate, now)
    }

    /// From now on, counts the requests let through for [`RateLimiter::take_unreported`].
    pub fn count_for_sharing(&self) {
        let mut u = self.unreported.lock().unwrap_or_else(|p| p.into_inner());
        u.get_or_insert_with(HashMap::new);
    }

    fn note_let_through(&self, tenant: &TenantId, class: RouteClass) {
        let mut u = self.unreported.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = u.as_mut() {
            *u.entry((tenant.clone(), class)).or_default() += 1;
        }
    }

    /// The requests let through since the last call (to report to the other controllers).
    pub fn take_unreported(&self) -> Vec<(TenantId, RouteClass, u64)> {
        let mut u = self.unreported.lock().unwrap_or_else(|p| p.into_inner());
        u.as_mut()
            .map(|m| m.drain().map(|((t, c), n)| (t, c, n)).collect())
            .unwrap_or_default()
    }

    /// Puts back a report that could not be sent (it goes with the next one).
    pub fn put_back_unreported(&self, usage: Vec<(TenantId, RouteClass, u64)>) {
        let mut u = self.unreported.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = u.as_mut() {
            for (t, c, n) in usage {
                *m.entry((t, c)).or_default() += n;
            }
        }
    }

    /// Takes `n` tokens from `tenant`'s `class` bucket at `now` for requests another
    /// controller let through ([`Bucket::debit_at`]).
    pub fn debit_at(&self, tenant: &TenantId, class: RouteClass, rate: u64, n: u64, now: Duration) {
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        b.entry((tenant.clone(), class))
            .or_insert_with(|| Bucket::full(rate, now))
            .debit_at(rate, n, now);
    }

    /// Requests another controller let through for `tenant`'s `class`: taken from its bucket
    /// here (nothing for the admin, or a tenant not limited).
    pub fn debit(
        &self,
        state: &(impl Rates + ?Sized),
        tenant: &TenantId,
        class: RouteClass,
        n: u64,
    ) {
        if *tenant == TenantId::admin() || n == 0 {
            return;
        }
        let rate = self.rate_of(state, tenant);
        if rate > 0 {
            self.debit_at(tenant, class, rate, n, self.start.elapsed());
        }
    }

    /// `tenant`'s rate: its quota's `requests_per_s`, else `default` (cached briefly).
    fn rate_of(&self, state: &(impl Rates + ?Sized), tenant: &TenantId) -> u64 {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let stale = c.fetched.is_none_or(|t| t.elapsed() > RATE_CACHE);
        if stale || !c.rates.contains_key(tenant) {
            match state.tenant_rates() {
                Ok(all) => {
                    c.rates = all.into_iter().collect();
                    c.fetched = Some(Instant::now());
                }
                Err(e) => tracing::warn!(error = %e, "cannot read tenants' rates"),
            }
        }
        c.rates
            .get(tenant)
            .copied()
            .flatten()
            .unwrap_or(state.default_rate())
    }
}

/// Weight budgets of in-flight file uploads, in MiB.
pub struct UploadSlots {
    global: Arc<Semaphore>,
    per_tenant: Mutex<HashMap<TenantId, Arc<Semaphore>>>,
    tenant_mib: u32,
}

/// What all uploads in flight may hold (bodies and their copies), in MiB.
pub const UPLOADS_GLOBAL_MIB: u32 = 1024;
/// What one tenant's uploads in flight may hold, in MiB.
pub const UPLOADS_TENANT_MIB: u32 = 512;

impl Default for UploadSlots {
    fn default() -> Self {
        UploadSlots::new(UPLOADS_GLOBAL_MIB, UPLOADS_TENANT_MIB)
    }
}

/// An upload's hold on the budgets; released when dropped.
pub struct UploadSlot {
    _global: OwnedSemaphorePermit,
    _tenant: OwnedSemaphorePermit,
}

/// Why an upload could not start.
#[derive(Debug, PartialEq, Eq)]
pub enum UploadRefused {
    /// The tenant's own uploads hold its budget.
    Tenant,
    /// The daemon's budget is spent (all tenants together).
    Global,
}

impl UploadSlots {
    pub fn new(global_mib: u32, tenant_mib: u32) -> UploadSlots {
        UploadSlots {
            global: Arc::new(Semaphore::new(global_mib as usize)),
            per_tenant: Mutex::default(),
            tenant_mib,
        }
    }

    /// The weight of a body of `len` bytes (unknown: the largest): twice its MiB, at least 1.
    pub fn weight(len: Option<u64>, max: u64) -> u32 {
        let len = len.unwrap_or(max).min(max);
        (len.div_ceil(1 << 20).saturating_mul(2)).clamp(1, u32::MAX as u64) as u32
    }

    /// Takes `weight` MiB from `tenant`'s budget and the daemon's, or says which is spent.
    pub fn try_take(&self, tenant: &TenantId, weight: u32) -> Result<UploadSlot, UploadRefused> {
        let tenant_sem = {
            let mut m = self.per_tenant.lock().unwrap_or_else(|p| p.into_inner());
            // Forget idle tenants' budgets (all permits back) so the map stays small.
            if m.len() > 1024 {
                let full = self.tenant_mib as usize;
                m.retain(|_, s| s.available_permits() < full);
            }
            m.entry(tenant.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.tenant_mib as usize)))
                .clone()
        };
        let t = tenant_sem
            .try_acquire_many_owned(weight.min(self.tenant_mib))
            .map_err(|_| UploadRefused::Tenant)?;
        let g = self
            .global
            .clone()
            .try_acquire_many_owned(weight)
            .map_err(|_| UploadRefused::Global)?;
        Ok(UploadSlot {
            _global: g,
            _tenant: t,
        })
    }
}

/// The edge's bookkeeping: rate-limit buckets and upload budgets.
#[derive(Default)]
pub struct EdgeLimits {
    pub rate: RateLimiter,
    pub uploads: UploadSlots,
}

/// Takes a token for `tenant`'s `class`: Ok (the headers are recorded for the response), or
/// `429 rate_limited`. The admin is never limited, nor is any tenant when its rate is 0.
pub fn check(
    state: &(impl Rates + ?Sized),
    tenant: &TenantId,
    class: RouteClass,
) -> Result<(), ApiError> {
    if *tenant == TenantId::admin() {
        return Ok(());
    }
    let lim = &state.limits().rate;
    let rate = lim.rate_of(state, tenant);
    if rate == 0 {
        return Ok(());
    }
    let d = lim.take_at(tenant, class, rate, lim.start.elapsed());
    let mut headers = HeaderMap::new();
    d.write_headers(&mut headers);
    crate::request_id::add_response_headers(headers);
    if d.allowed {
        lim.note_let_through(tenant, class);
        return Ok(());
    }
    tracing::info!(tenant = %tenant, class = class.as_str(), "rate limited");
    Err(ApiError::new(
        ErrorKind::RateLimited,
        "rate_limited",
        format!(
            "over the rate of {rate} requests per second for {} calls; retry in {} s",
            class.as_str(),
            d.retry_after_s
        ),
    )
    .with_retry_after(d.retry_after_s))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_bucket_lets_a_burst_of_twice_the_rate_then_the_rate() {
        let mut b = Bucket::full(5, Duration::ZERO);
        for i in 0..10 {
            let d = b.take_at(5, Duration::ZERO);
            assert!(d.allowed, "request {i} of the burst");
            assert_eq!(d.limit, 10);
            assert_eq!(d.remaining, 9 - i);
        }
        let d = b.take_at(5, Duration::ZERO);
        assert!(!d.allowed);
        assert_eq!((d.remaining, d.retry_after_s, d.reset_s), (0, 1, 2));
        // A second later: five more (the rate), not ten.
        let allowed = (0..10).filter(|_| b.take_at(5, S).allowed).count();
        assert_eq!(allowed, 5);
        // Long idle: full again, never more than the burst.
        let allowed = (0..30).filter(|_| b.take_at(5, 100 * S).allowed).count();
        assert_eq!(allowed, 10);
    }

    #[test]
    fn retry_after_is_whole_seconds_and_at_least_one() {
        let mut b = Bucket::full(1, Duration::ZERO);
        assert!(b.take_at(1, Duration::ZERO).allowed);
        assert!(b.take_at(1, Duration::ZERO).allowed);
        let d = b.take_at(1, Duration::ZERO);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_s, 1);
        // Half a token back: still refused, still told 1 s (not 0).
        let d = b.take_at(1, Duration::from_millis(500));
        assert!(!d.allowed);
        assert_eq!(d.retry_after_s, 1);
        assert!(b.take_at(1, Duration::from_millis(1000)).allowed);
        // A clock that goes back does not mint tokens.
        let d = b.take_at(1, Duration::ZERO);
        assert!(!d.allowed);
    }

    #[test]
    fn requests_let_through_elsewhere_are_taken_from_the_bucket_and_owed_at_most_its_size() {
        let l = RateLimiter::default();
        let a = TenantId::new("team-a").unwrap();
        let t = Duration::ZERO;
        // Rate 2, burst 4: another controller let 3 through; one is left here.
        l.debit_at(&a, RouteClass::Exec, 2, 3, t);
        assert!(l.take_at(&a, RouteClass::Exec, 2, t).allowed);
        assert!(!l.take_at(&a, RouteClass::Exec, 2, t).allowed);
        // Far more elsewhere: owed down to one bucket below empty (4 tokens: 2 s at rate 2),
        // no more.
        l.debit_at(&a, RouteClass::Exec, 2, 1000, t);
        assert!(!l.take_at(&a, RouteClass::Exec, 2, S).allowed);
        assert!(!l.take_at(&a, RouteClass::Exec, 2, 2 * S).allowed);
        assert!(l.take_at(&a, RouteClass::Exec, 2, 3 * S).allowed);
        // Another class's bucket is untouched.
        assert!(l.take_at(&a, RouteClass::Files, 2, t).allowed);

        // Counting for the others starts when asked; what is let through is reported once.
        assert!(l.take_unreported().is_empty());
        l.count_for_sharing();
        l.note_let_through(&a, RouteClass::Exec);
        l.note_let_through(&a, RouteClass::Exec);
        let usage = l.take_unreported();
        assert_eq!(usage, vec![(a.clone(), RouteClass::Exec, 2)]);
        assert!(l.take_unreported().is_empty());
        l.put_back_unreported(usage);
        l.note_let_through(&a, RouteClass::Exec);
        assert_eq!(l.take_unreported(), vec![(a.clone(), RouteClass::Exec, 3)]);
        for c in [
            RouteClass::Lifecycle,
            RouteClass::Exec,
            RouteClass::Files,
            RouteClass::Proxy,
        ] {
            assert_eq!(RouteClass::parse(c.as_str()), Some(c));
        }
        assert_eq!(RouteClass::parse("admin"), None);
    }

    #[test]
    fn tenants_and_classes_have_their_own_buckets() {
        let l = RateLimiter::default();
        let a = TenantId::new("team-a").unwrap();
        let b = TenantId::new("team-b").unwrap();
        let t = Duration::ZERO;
        for _ in 0..4 {
            assert!(l.take_at(&a, RouteClass::Exec, 2, t).allowed);
        }
        assert!(!l.take_at(&a, RouteClass::Exec, 2, t).allowed);
        assert!(l.take_at(&a, RouteClass::Files, 2, t).allowed);
        assert!(l.take_at(&b, RouteClass::Exec, 2, t).allowed);
    }

    #[test]
    fn v1_paths_map_to_their_class() {
        use RouteClass::*;
        for (p, c) in [
            ("/sandboxes/sb-1/exec", Exec),
            ("/v1/sandboxes/sb-1/files", Files),
            ("/sandboxes/sb-1/ports/80/x", Proxy),
            ("/sandboxes", Lifecycle),
            ("/sandboxes/sb-1/fork", Lifecycle),
            ("/templates/x", Lifecycle),
            ("/tenants", Lifecycle),
        ] {
            assert_eq!(RouteClass::of_v1_path(p), c, "{p}");
        }
    }

    #[test]
    fn upload_budgets_refuse_past_the_tenant_then_the_daemon() {
        let slots = UploadSlots::new(10, 6);
        let a = TenantId::new("team-a").unwrap();
        let b = TenantId::new("team-b").unwrap();
        let first = slots.try_take(&a, 4).unwrap();
        assert_eq!(slots.try_take(&a, 4).err(), Some(UploadRefused::Tenant));
        let second = slots.try_take(&b, 6).unwrap();
        assert_eq!(slots.try_take(&b, 1).err(), Some(UploadRefused::Tenant));
        assert_eq!(slots.try_take(&a, 2).err(), Some(UploadRefused::Global));
        drop(first);
        assert!(slots.try_take(&a, 4).is_ok());
        drop(second);
        assert_eq!(UploadSlots::weight(Some(0), 1 << 30), 1);
        assert_eq!(UploadSlots::weight(Some(3 << 20), 1 << 30), 6);
        assert_eq!(UploadSlots::weight(None, 256 << 20), 512);
    }
}
