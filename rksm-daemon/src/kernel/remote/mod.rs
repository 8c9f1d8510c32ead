//! Remote system calls: run a system call inside a target process, and leave no trace.
//!
//! Some things can only be done from inside a process: `madvise(MADV_MERGEABLE)` (the kernel
//! refuses it through `process_madvise` for another process) and creating a userfaultfd that
//! belongs to the target's mm. rksm does them by borrowing one thread for a moment:
//! `PTRACE_SEIZE` + `PTRACE_INTERRUPT` stop that thread only (the others keep running), its
//! registers are saved, each call is made by pointing the thread at a `syscall` instruction
//! that already exists in its vDSO and single-stepping it, and finally the saved registers are
//! restored and the thread detached. Restoring `orig_rax`/`rax` as they were lets the kernel
//! restart a system call the thread was sleeping in, exactly as after any signal. Many calls
//! share one stop. Targets that cannot be borrowed safely (already traced, under seccomp,
//! which might kill them for our call, stopped, in uninterruptible sleep, 32-bit) are
//! refused before anything is done to them.
//!
//! The borrow follows CRIU's compel (infect.c). A thread stopped inside an rseq critical
//! section is first sent to the section's abort handler, as the kernel would send it
//! ([`rseq`]). A signal that arrives before the interrupt's
//! stop is handed straight back with `PTRACE_CONT` (its siginfo intact); once stopped, every
//! signal is blocked with `PTRACE_SETSIGMASK` for each injected call, so nothing is dequeued
//! and nothing needs resending, and the mask (and the registers) are put back right after
//! it: between calls the thread holds its own. While it holds a thread rksm is out of the
//! OOM killer's reach ([`oom`]). A stop is taken as
//! the injected call's only if the instruction pointer is past the `syscall`, `orig_rax` is
//! the call's number and the code segment is 64-bit; retries are bounded. Every wait has a
//! deadline: a thread that does not stop in time is given up, and it is let go (registers
//! and mask restored if they were changed) as soon as it does stop ([`Borrower::reap_lingering`]).
//!
//! The thread borrowed is the one least likely to notice: one running in user space, or
//! asleep in a call the kernel restarts by itself, before one asleep in a call that returns
//! EINTR when interrupted (`epoll_wait`, socket calls with timeouts, SysV IPC, io_uring). If
//! such a call was interrupted anyway, an `epoll_wait` or `epoll_pwait` is handed back to the
//! kernel as a call to restart (`-ERESTARTNOHAND`: it returns EINTR only if a signal handler
//! runs, as it would have), with the time it had left if it had a timeout and its entry was
//! seen ([`set_call_entry`]); any other is counted ([`BorrowCounters::eintr_risk`]).
//!
//! The parts: [`arch`] (registers and the call, per architecture), `threads` (choosing the
//! thread, its signal mask, waiting for its stops), `session` (one borrow, start to end) and
//! `borrower` (what sessions leave behind: counts, and threads still to let go).

use std::{fmt, time::Duration};

use nix::errno::Errno;

use crate::kernel::{procfs, rseq::RseqError};

mod arch;
mod borrower;
mod session;
mod threads;

pub use borrower::{BorrowCounters, Borrower};
pub use session::{set_call_entry, RemoteSession};
pub use threads::monotonic_ns;
use threads::{choose_thread, is_32bit_program};

/// System call numbers used remotely (the target's architecture is rksm's own: a compat
/// process is never borrowed).
pub mod nr {
    /// `close(fd)`.
    pub const CLOSE: u64 = libc::SYS_close as u64;
    /// `madvise(addr, len, advice)`.
    pub const MADVISE: u64 = libc::SYS_madvise as u64;
    /// `getpid()`.
    pub const GETPID: u64 = libc::SYS_getpid as u64;
    /// `userfaultfd(flags)`.
    pub const USERFAULTFD: u64 = libc::SYS_userfaultfd as u64;
}

/// How long a thread may take to reach the interrupt's stop. A thread running or asleep
/// interruptibly stops in microseconds; one that does not within this is in a wait rksm
/// will not sit out (a FUSE request, a vfork parent, a disk wait).
pub const STOP_DEADLINE: Duration = Duration::from_millis(500);
/// How long one injected call may take (`madvise` over a large range walks its pages).
pub const CALL_DEADLINE: Duration = Duration::from_secs(5);
/// Attempts at one call before the borrow is given up: a stop that is not the call's (an
/// unblockable SIGSTOP) costs one.
pub(crate) const CALL_ATTEMPTS: u32 = 4;

/// Why a target cannot be borrowed for remote system calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RemoteRefusal {
    /// Another tracer (a debugger, strace) is attached.
    Traced,
    /// Seccomp (strict mode or a filter) could kill the process for a call it does not expect.
    Seccomp,
    /// The process is stopped (SIGSTOP, job control); resuming it would be a surprise.
    Stopped,
    /// Every thread is in uninterruptible sleep; waiting for one could block rksm.
    UninterruptibleSleep,
    /// No `syscall` instruction in its vDSO (no vDSO, or an unexpected one).
    NoVdso,
    /// A 32-bit (compat or x32) program: `syscall` and the call numbers mean something else.
    Compat,
    /// The process made itself non-dumpable (`PR_SET_DUMPABLE` 0), as it said when asked in
    /// the borrow: its /proc files cannot say so when it runs as root.
    NonDumpable,
}

impl RemoteRefusal {
    /// Whether the reason lasts as long as the process (seccomp cannot be turned off, a
    /// program stays 32-bit until it executes another); the others can pass: a tracer
    /// detaches, a stop or a disk wait ends, and a process caught in the middle of an exec
    /// has no vDSO mapped for a moment.
    pub fn is_lasting(self) -> bool {
        matches!(
            self,
            RemoteRefusal::Seccomp | RemoteRefusal::Compat | RemoteRefusal::NonDumpable
        )
    }

    /// Stable short name, used as a counter label.
    pub fn as_str(self) -> &'static str {
        match self {
            RemoteRefusal::Traced => "traced",
            RemoteRefusal::Seccomp => "seccomp",
            RemoteRefusal::Stopped => "stopped",
            RemoteRefusal::UninterruptibleSleep => "uninterruptible_sleep",
            RemoteRefusal::NoVdso => "no_vdso",
            RemoteRefusal::Compat => "compat",
            RemoteRefusal::NonDumpable => "non_dumpable",
        }
    }
}

impl fmt::Display for RemoteRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RemoteRefusal::Traced => "it is already being traced",
            RemoteRefusal::Seccomp => "it runs under seccomp",
            RemoteRefusal::Stopped => "it is stopped",
            RemoteRefusal::UninterruptibleSleep => "every thread is in uninterruptible sleep",
            RemoteRefusal::NoVdso => "it has no vDSO syscall instruction to borrow",
            RemoteRefusal::Compat => "it is a 32-bit program",
            RemoteRefusal::NonDumpable => "it is not dumpable (it said so when asked)",
        })
    }
}

/// Errors of a remote-syscall session.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The target is refused, untouched.
    #[error("pid {pid}: not borrowing a thread because {reason}")]
    Refused {
        /// The process.
        pid: u32,
        /// Why.
        reason: RemoteRefusal,
    },
    /// The target exited.
    #[error("pid {0} exited")]
    Gone(u32),
    /// The target executed a new program since it was opened: the addresses the caller
    /// holds belong to an address space that no longer exists. Nothing was done to it.
    #[error("pid {0} executed a new program since it was scanned")]
    NewImage(u32),
    /// The thread did not stop in time; it is let go as soon as it does.
    #[error("pid {pid}: thread {tid} did not stop within {:?}; given up", deadline)]
    NoStop {
        /// The process.
        pid: u32,
        /// The thread.
        tid: i32,
        /// The bound it missed.
        deadline: Duration,
    },
    /// Stops that were not the injected call's came back every time.
    #[error("pid {0}: the injected call did not complete after {CALL_ATTEMPTS} attempts; its registers were restored")]
    Unsettled(u32),
    /// The thread's rseq state could not be settled; it was let go untouched.
    #[error("pid {pid}: {source}; let go untouched")]
    Rseq {
        /// The process.
        pid: u32,
        /// What was wrong.
        source: RseqError,
    },
    /// Remote system calls are not implemented for this architecture.
    #[error("remote system calls are implemented for x86_64 only; rksm cannot mark or arm targets here (`rksm estimate` and `rksm trace` still work)")]
    Unsupported,
    /// A ptrace operation failed.
    #[error("pid {pid}: ptrace {op}: {errno}")]
    Ptrace {
        /// The process.
        pid: u32,
        /// Which operation.
        op: &'static str,
        /// What the kernel said.
        errno: Errno,
    },
}

/// What /proc says about whether a process can be borrowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BorrowStatus {
    tracer_pid: u32,
    seccomp: u32,
    state: char,
}

impl BorrowStatus {
    pub(crate) fn parse(status: &str) -> Option<Self> {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        Some(BorrowStatus {
            tracer_pid: field("TracerPid:")?.parse().ok()?,
            seccomp: field("Seccomp:").unwrap_or("0").parse().ok()?,
            state: field("State:")?.chars().next()?,
        })
    }

    pub(crate) fn refusal(&self) -> Option<RemoteRefusal> {
        if self.tracer_pid != 0 {
            Some(RemoteRefusal::Traced)
        } else if self.seccomp != 0 {
            Some(RemoteRefusal::Seccomp)
        } else if matches!(self.state, 'T' | 't') {
            Some(RemoteRefusal::Stopped)
        } else {
            None
        }
    }
}

/// Checks whether `pid` can be borrowed, without touching it.
///
/// The daemon asks this of every target every pass, so the threads are looked at one by one
/// only when the main thread is in a disk wait: otherwise the main thread itself could be
/// borrowed, and [`RemoteSession::begin`] picks the best one when it is needed.
pub fn check_borrowable(pid: u32) -> Result<(), RemoteError> {
    let status =
        procfs::read_text(format!("/proc/{pid}/status")).map_err(|_| RemoteError::Gone(pid))?;
    let stat = procfs::read_text(format!("/proc/{pid}/stat")).unwrap_or_default();
    check_borrowable_as(pid, &status, &stat)
}

/// [`check_borrowable`], as the process's /proc/PID/`status` and `stat` read a moment ago
/// say.
pub fn check_borrowable_as(pid: u32, status: &str, stat: &str) -> Result<(), RemoteError> {
    let refused = |reason| Err(RemoteError::Refused { pid, reason });
    let status = BorrowStatus::parse(status);
    if let Some(reason) = status.as_ref().and_then(BorrowStatus::refusal) {
        return refused(reason);
    }
    if is_32bit_program(stat) {
        return refused(RemoteRefusal::Compat);
    }
    match status {
        Some(s) if s.state == 'D' => choose_thread(pid).map(drop),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn status_parsing_never_panics(status in "\\PC*") {
            let _ = BorrowStatus::parse(&status).map(|s| s.refusal());
        }
    }

    #[test]
    fn refusals_come_from_proc_status() {
        let status = |tracer: u32, seccomp: u32, state: &str| {
            format!("Name:\tx\nState:\t{state}\nTracerPid:\t{tracer}\nSeccomp:\t{seccomp}\n")
        };
        let refusal = |s: String| BorrowStatus::parse(&s).unwrap().refusal();
        assert_eq!(refusal(status(0, 0, "S (sleeping)")), None);
        assert_eq!(
            refusal(status(0, 1, "R (running)")),
            Some(RemoteRefusal::Seccomp),
            "strict mode kills on madvise"
        );
        assert_eq!(
            refusal(status(77, 0, "S (sleeping)")),
            Some(RemoteRefusal::Traced)
        );
        assert_eq!(
            refusal(status(0, 2, "S (sleeping)")),
            Some(RemoteRefusal::Seccomp)
        );
        assert_eq!(
            refusal(status(0, 0, "T (stopped)")),
            Some(RemoteRefusal::Stopped)
        );
        assert_eq!(
            refusal(status(0, 0, "t (tracing stop)")),
            Some(RemoteRefusal::Stopped)
        );
        // A disk wait is one thread's: another may be borrowed (see `disturbance`).
        assert_eq!(refusal(status(0, 0, "D (disk sleep)")), None);
        assert_eq!(BorrowStatus::parse("Name:\tx\n"), None);
    }
}
