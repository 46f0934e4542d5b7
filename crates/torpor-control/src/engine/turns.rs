//! How many checkpoints and restores run at once: one of each per core of the machines that
//! run them. On one machine that is its cores, fixed; in cluster mode the sum of the ready
//! workers' cores, resized as workers join and leave (each worker also holds its own starts and
//! checkpoints to its cores, whichever controller asks).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A resizable pool of turns.
///
/// Growing adds turns at once. Shrinking takes away the free turns at once; a turn taken now is
/// owed and is taken away when it comes back, at the next [`Turns::take`] that finds it (a
/// later growth cancels what is still owed first), so the pool never ends up smaller or larger
/// than its size.
pub(crate) struct Turns {
    sem: Arc<Semaphore>,
    /// Turns there are: what [`Turns::resize`] last set.
    size: AtomicUsize,
    /// Turns to take away as they come back (a shrink while they were taken).
    owed: AtomicUsize,
}

impl Turns {
    pub(crate) fn new(size: usize) -> Turns {
        let size = size.max(1);
        Turns {
            sem: Arc::new(Semaphore::new(size)),
            size: AtomicUsize::new(size),
            owed: AtomicUsize::new(0),
        }
    }

    /// Waits for a turn.
    pub(crate) async fn take(&self) -> OwnedSemaphorePermit {
        loop {
            let permit = self
                .sem
                .clone()
                .acquire_owned()
                .await
                .expect("the turns' semaphore is never closed");
            let paid = self
                .owed
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |o| o.checked_sub(1))
                .is_ok();
            if !paid {
                return permit;
            }
            permit.forget();
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.size.load(Ordering::SeqCst)
    }

    /// Turns taken now.
    pub(crate) fn busy(&self) -> usize {
        (self.size() + self.owed.load(Ordering::SeqCst))
            .saturating_sub(self.sem.available_permits())
    }

    /// Sets how many turns there are (at least one). Turns taken keep running.
    pub(crate) fn resize(&self, size: usize) {
        let size = size.max(1);
        let old = self.size.swap(size, Ordering::SeqCst);
        if size > old {
            let grow = size - old;
            // What a shrink still owes is cancelled first.
            let owed = self
                .owed
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |o| {
                    Some(o - o.min(grow))
                })
                .unwrap_or_else(|o| o);
            self.sem.add_permits(grow - owed.min(grow));
        } else if size < old {
            let gone = old - size;
            let forgotten = self.sem.forget_permits(gone);
            self.owed.fetch_add(gone - forgotten, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn blocked(t: &Turns) -> bool {
        tokio::time::timeout(Duration::from_millis(50), t.take())
            .await
            .is_err()
    }

    #[tokio::test]
    async fn turns_grow_and_shrink_with_those_taken_kept() {
        let t = Turns::new(2);
        let a = t.take().await;
        let b = t.take().await;
        assert_eq!(t.busy(), 2);
        t.resize(4);
        assert_eq!((t.size(), t.busy()), (4, 2));
        let c = t.take().await;
        let d = t.take().await;
        assert_eq!(t.busy(), 4);
        // Down to one while four are taken: none is cut, and only one runs once they end.
        t.resize(1);
        assert_eq!((t.size(), t.busy()), (1, 4));
        drop((a, b, c, d));
        let _e = t.take().await;
        assert_eq!(t.busy(), 1);
        assert!(blocked(&t).await, "one turn only");
    }

    #[tokio::test]
    async fn a_growth_after_a_shrink_cancels_what_is_owed() {
        let t = Turns::new(6);
        let taken: Vec<_> = futures_take(&t, 6).await;
        t.resize(2);
        t.resize(6);
        drop(taken);
        let again = futures_take(&t, 6).await;
        assert_eq!(t.busy(), 6);
        assert!(blocked(&t).await, "six turns, not more");
        drop(again);
        assert_eq!(t.busy(), 0);
    }

    async fn futures_take(t: &Turns, n: usize) -> Vec<OwnedSemaphorePermit> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(t.take().await);
        }
        out
    }
}
