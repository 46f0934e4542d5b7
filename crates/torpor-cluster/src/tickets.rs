//! Wake tickets a worker was told to drop and did not hear, asked again by any controller.
//!
//! A controller tells a GPU worker to drop a sandbox's wake ticket (`ForgetGpuTickets`) when
//! the sandbox is deleted or wakes on another worker. A call that fails (the worker is away
//! for a moment) is asked again from the controller's memory (`fleet::spawn_forget_ticket`:
//! 1 s doubling to a minute, for an hour), and is also kept in the controllers' database
//! ([`TicketBook`]) so that a controller restart in that hour does not leave the ticket behind:
//! every controller sweeps the book [`FIRST_SWEEP_AFTER`] its start and every [`SWEEP_EVERY`] ([`sweep_once`]),
//! asks the workers that are reachable, and removes what they answered and what is older than
//! [`GIVE_UP_AFTER`]. Asking twice is harmless: a worker drops a ticket once and answers the
//! same for one it does not have.

use std::future::Future;
use std::time::Duration;

/// How often a controller sweeps the book.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// When a controller sweeps first after its start (its workers register again meanwhile).
pub const FIRST_SWEEP_AFTER: Duration = Duration::from_secs(10);
/// How long a ticket is asked for before it is given up on (logged).
pub const GIVE_UP_AFTER: Duration = Duration::from_secs(3600);
/// The most tickets one sweep asks for.
pub const SWEEP_MAX: usize = 1024;

/// Where the controllers of one database keep the tickets still to drop (the state store, in
/// the binary). Calls block (a database round trip).
pub trait TicketBook: Send + Sync {
    /// `worker` still has to be told to drop `sandbox`'s ticket.
    fn keep(&self, worker: &str, sandbox: &str) -> Result<(), String>;
    /// The oldest `limit` tickets still to drop: `(worker, sandbox, age)`, oldest first.
    fn pending(&self, limit: usize) -> Result<Vec<(String, String, Duration)>, String>;
    /// Told (or given up on).
    fn done(&self, worker: &str, sandbox: &str) -> Result<(), String>;
}

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub dropped: usize,
    pub given_up: usize,
    /// Asked and failed, or the worker is not reachable now: kept for the next sweep.
    pub left: usize,
}

/// Asks for every pending ticket once: `ask(worker, sandbox)` answers `None` when the worker is
/// not reachable now (not asked), else the call's result.
pub async fn sweep_once<F, Fut>(book: &dyn TicketBook, mut ask: F) -> Result<Swept, String>
where
    F: FnMut(String, String) -> Option<Fut>,
    Fut: Future<Output = Result<(), String>>,
{
    let mut swept = Swept::default();
    for (worker, sandbox, age) in book.pending(SWEEP_MAX)? {
        if age >= GIVE_UP_AFTER {
            tracing::warn!(%worker, %sandbox, "a worker kept a wake ticket it was asked to drop (gave up asking)");
            book.done(&worker, &sandbox)?;
            swept.given_up += 1;
            continue;
        }
        let Some(call) = ask(worker.clone(), sandbox.clone()) else {
            swept.left += 1;
            continue;
        };
        match call.await {
            Ok(()) => {
                book.done(&worker, &sandbox)?;
                swept.dropped += 1;
            }
            Err(error) => {
                tracing::debug!(%worker, %sandbox, %error, "a ticket to drop: asked again later");
                swept.left += 1;
            }
        }
    }
    Ok(swept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Book(Mutex<Vec<(String, String, Duration)>>);

    impl TicketBook for Book {
        fn keep(&self, worker: &str, sandbox: &str) -> Result<(), String> {
            let mut v = self.0.lock().unwrap();
            if !v.iter().any(|(w, s, _)| w == worker && s == sandbox) {
                v.push((worker.into(), sandbox.into(), Duration::ZERO));
            }
            Ok(())
        }
        fn pending(&self, limit: usize) -> Result<Vec<(String, String, Duration)>, String> {
            Ok(self.0.lock().unwrap().iter().take(limit).cloned().collect())
        }
        fn done(&self, worker: &str, sandbox: &str) -> Result<(), String> {
            self.0
                .lock()
                .unwrap()
                .retain(|(w, s, _)| !(w == worker && s == sandbox));
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_sweep_asks_reachable_workers_keeps_the_rest_and_gives_up_in_time() {
        let book = Book::default();
        book.keep("ga", "sb-1").unwrap();
        book.keep("gb", "sb-2").unwrap();
        book.keep("gc", "sb-3").unwrap();
        book.keep("ga", "sb-old").unwrap();
        book.0.lock().unwrap()[3].2 = GIVE_UP_AFTER;
        // ga answers, gb fails, gc is not reachable now.
        let swept = sweep_once(&book, |worker, _| match worker.as_str() {
            "ga" => Some(std::future::ready(Ok(()))),
            "gb" => Some(std::future::ready(Err("unavailable".to_string()))),
            _ => None,
        })
        .await
        .unwrap();
        assert_eq!(
            swept,
            Swept {
                dropped: 1,
                given_up: 1,
                left: 2
            }
        );
        let left: Vec<_> = book
            .pending(SWEEP_MAX)
            .unwrap()
            .into_iter()
            .map(|(w, _, _)| w)
            .collect();
        assert_eq!(left, ["gb", "gc"]);
        // Once they answer, nothing is left.
        let swept = sweep_once(&book, |_, _| Some(std::future::ready(Ok(()))))
            .await
            .unwrap();
        assert_eq!(swept.dropped, 2);
        assert!(book.pending(SWEEP_MAX).unwrap().is_empty());
    }
}
