//! How many checkpoints and restores run at once: one of each per core of the machines that
//! run them. On one machine that is its cores, fixed; in cluster mode the sum of the ready
//! workers' cores, resized as workers join and leave (each worker also holds its own starts and
//! checkpoints to its cores, whichever controller asks).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A resizable pool of turns.
pub(crate) struct Turns {
    sem: Arc<Semaphore>,
    /// Turns there are (some may be taken): what [`Turns::resize`] last set.
    size: AtomicUsize,
}

impl Turns {
    pub(crate) fn new(size: usize) -> Turns {
        let size = size.max(1);
        Turns {
            sem: Arc::new(Semaphore::new(size)),
            size: AtomicUsize::new(size),
        }
    }

    /// Waits for a turn.
    pub(crate) async fn take(&self) -> OwnedSemaphorePermit {
        self.sem
            .clone()
            .acquire_owned()
            .await
            .expect("the turns' semaphore is never closed")
    }

    pub(crate) fn size(&self) -> usize {
        self.size.load(Ordering::SeqCst)
    }

    /// Turns taken now.
    pub(crate) fn busy(&self) -> usize {
        self.size().saturating_sub(self.sem.available_permits())
    }

    /// Sets how many turns there are (at least one). Turns taken keep running; a smaller size
    /// takes effect as they are given back.
    pub(crate) fn resize(&self, size: usize) {
        let size = size.max(1);
        let old = self.size.swap(size, Ordering::SeqCst);
        if size > old {
            self.sem.add_permits(size - old);
        } else if size < old {
            let gone = old - size;
            let forgotten = self.sem.forget_permits(gone);
            if forgotten < gone {
                // The rest are taken: forget them as they come back.
                let sem = self.sem.clone();
                let owed = (gone - forgotten) as u32;
                tokio::spawn(async move {
                    if let Ok(p) = sem.acquire_many_owned(owed).await {
                        p.forget();
                    }
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(t.size(), 1);
        drop((a, b, c, d));
        tokio::task::yield_now().await;
        for _ in 0..100 {
            if t.sem.available_permits() == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(t.sem.available_permits(), 1);
        let _e = t.take().await;
        assert!(t.sem.clone().try_acquire_owned().is_err());
        assert_eq!(t.busy(), 1);
    }
}
