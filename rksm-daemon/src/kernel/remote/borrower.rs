//! The borrower: the one value every borrow starts from, and what it keeps.
//!
//! Borrowing leaves two things behind a session: what it did (threads borrowed, calls
//! interrupted with EINTR, rseq sections aborted, timed waits entered again), which the
//! daemon reports, and the threads that did not stop in time, which must be let go as soon
//! as they do. Both belong to the [`Borrower`] the sessions started from, not to the
//! process: only the thread that seized a thread can wait for it, so a borrower is made,
//! used and dropped on one thread (it is neither `Send` nor `Sync`), and whoever owns it
//! reads its counts from zero.

use std::{
    cell::{Cell, RefCell},
    marker::PhantomData,
};

use nix::unistd::Pid;

use super::{
    arch,
    threads::{poll_stop, resume_with, sigmask, Stop},
};
use crate::kernel::oom;

/// What a borrower did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BorrowCounters {
    /// Threads borrowed (stopped and let go again).
    pub borrows: u64,
    /// Borrows whose thread came back from an interrupted call with EINTR that rksm could
    /// not restart: the target may have noticed.
    pub eintr_risk: u64,
    /// Borrowed threads that were inside an rseq critical section, which rksm aborted as the
    /// kernel would have.
    pub rseq_aborts: u64,
    /// Timed waits a borrow interrupted and entered again with the time they had left.
    pub timed_restarts: u64,
}

/// A thread seized but not stopped in time, or stopped mid-call when time ran out: let go
/// (with what it had restored) as soon as it stops.
struct Lingering {
    tid: Pid,
    restore: Option<(arch::Regs, Option<u64>)>,
    /// rksm stays out of the OOM killer's reach while it holds the thread.
    _shield: oom::Shield,
}

/// Starts borrows ([`super::RemoteSession::begin`]), counts them, and lets go of the
/// threads they had to give up. Threads still lingering when it is dropped stay seized until
/// rksm exits (the kernel then lets them go as they are); the daemon reaps them, with a
/// deadline, before it stops.
#[derive(Default)]
pub struct Borrower {
    counters: Cell<BorrowCounters>,
    lingering: RefCell<Vec<Lingering>>,
    /// Only the thread that seized a thread can wait for it: the borrower stays on its own.
    _one_thread: PhantomData<*const ()>,
}

impl Borrower {
    /// A borrower that has borrowed nothing.
    pub fn new() -> Self {
        Borrower::default()
    }

    /// What it did so far.
    pub fn counters(&self) -> BorrowCounters {
        self.counters.get()
    }

    /// Counts something a session did.
    pub(super) fn count(&self, what: impl FnOnce(&mut BorrowCounters)) {
        let mut counters = self.counters.get();
        what(&mut counters);
        self.counters.set(counters);
    }

    /// Keeps `tid`, given up, to be let go when it stops, with `restore` (its registers and
    /// signal mask) put back first if they were changed.
    pub(super) fn linger(&self, tid: Pid, restore: Option<(arch::Regs, Option<u64>)>) {
        self.lingering.borrow_mut().push(Lingering {
            tid,
            restore,
            _shield: oom::Shield::raise(),
        });
    }

    /// Lets go of threads that stopped since they were given up; returns how many are still
    /// waited for. Called before every borrow, and by the daemon while it sleeps between
    /// passes.
    pub fn reap_lingering(&self) -> usize {
        let mut lingering = self.lingering.borrow_mut();
        lingering.retain(|l| {
            let signal = match poll_stop(l.tid) {
                Ok(None) => return true,
                Ok(Some(Stop::Signal(sig))) if sig != libc::SIGTRAP => sig,
                Ok(Some(Stop::Signal(_) | Stop::Interrupted(_) | Stop::Event)) => 0,
                Ok(Some(Stop::Gone)) | Err(_) => return false,
            };
            if let Some((regs, mask)) = l.restore {
                if let Some(mask) = mask {
                    let _ = sigmask(l.tid, Some(mask));
                }
                let _ = arch::set(l.tid, regs);
            }
            // From a signal-delivery stop, detaching with the signal delivers it as it came.
            let _ = resume_with(libc::PTRACE_DETACH, l.tid, signal);
            log::info!("thread {} stopped after all and was let go", l.tid);
            false
        });
        lingering.len()
    }
}

impl std::fmt::Debug for Borrower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Borrower")
            .field("counters", &self.counters.get())
            .field("lingering", &self.lingering.borrow().len())
            .finish()
    }
}
