//! One borrowed thread: stopped, its state saved, system calls made in it, and let go as
//! it was (see the module documentation of [`super`] for how, and why it goes unnoticed).

use std::{
    sync::OnceLock,
    time::{Duration, Instant},
};

use nix::{errno::Errno, sys::ptrace, unistd::Pid};

use super::{
    arch,
    borrower::Borrower,
    check_borrowable,
    threads::{
        choose_thread, monotonic_ns, resume_with, sigmask, vdso_syscall_instruction, wait_until,
        Stop,
    },
    RemoteError, RemoteRefusal, CALL_ATTEMPTS, CALL_DEADLINE, STOP_DEADLINE,
};
use crate::kernel::{oom, process::Process, reader::ProcMem, rseq};

/// Where the entry time of a thread's current wait comes from: `(pid, tid)` → CLOCK_MONOTONIC
/// nanoseconds at entry (the eBPF wait watch, when loaded).
static CALL_ENTRY: OnceLock<fn(u32, u32) -> Option<u64>> = OnceLock::new();

/// Gives the borrow the entry times of the targets' waits, so that a timed `epoll_wait` it
/// interrupts is entered again with the time it had left rather than return EINTR.
pub fn set_call_entry(source: fn(u32, u32) -> Option<u64>) {
    let _ = CALL_ENTRY.set(source);
}

/// What a failed ptrace request `op` on a thread of `pid` means: ESRCH is a thread that is
/// gone (or no longer stopped for the tracer, which for rksm ends the session the same way).
fn ptrace_error(pid: u32, op: &'static str) -> impl Fn(Errno) -> RemoteError {
    move |errno| match errno {
        Errno::ESRCH => RemoteError::Gone(pid),
        errno => RemoteError::Ptrace { pid, op, errno },
    }
}

/// One thread of a target, stopped and borrowed for system calls. Dropping the session
/// restores the thread's registers and signal mask and lets it go;
/// [`RemoteSession::finish`] does the same and reports errors.
pub struct RemoteSession<'b> {
    /// The borrower it started from: counts what it does, and keeps the thread if it has to
    /// be given up.
    borrower: &'b Borrower,
    pid: u32,
    tid: Pid,
    /// The thread's registers when it stopped; `None` until they were read, and then nothing
    /// is written back.
    saved: Option<arch::Regs>,
    /// Its signal mask when it stopped; `None` until it was read and replaced.
    saved_mask: Option<u64>,
    syscall_at: u64,
    /// A SIGSTOP (which no mask blocks) came while the thread was held: sent again when it
    /// is let go. It carries nothing that resending loses.
    stop_signal: bool,
    calls: u64,
    released: bool,
    /// rksm stays out of the OOM killer's reach while it holds the thread.
    _shield: oom::Shield,
}

impl<'b> RemoteSession<'b> {
    /// Stops one thread of `process` (the least disturbed, see the module documentation),
    /// saves its registers and blocks its signals.
    pub fn begin(borrower: &'b Borrower, process: &Process) -> Result<Self, RemoteError> {
        if !cfg!(target_arch = "x86_64") {
            return Err(RemoteError::Unsupported);
        }
        let pid = process.pid();
        borrower.reap_lingering();
        check_borrowable(pid)?;
        let tid = choose_thread(pid)?;
        let syscall_at = vdso_syscall_instruction(pid)?;
        let ptrace_err = |op| ptrace_error(pid, op);
        let shield = oom::Shield::raise();
        // Seize rather than attach: no SIGSTOP is sent, so nothing the target or its parent
        // can observe happens.
        ptrace::seize(tid, ptrace::Options::empty()).map_err(ptrace_err("seize"))?;
        let mut session = RemoteSession {
            borrower,
            pid,
            tid,
            saved: None,
            saved_mask: None,
            syscall_at,
            stop_signal: false,
            calls: 0,
            released: false,
            _shield: shield,
        };
        if let Err(errno) = ptrace::interrupt(tid) {
            session.released = true;
            if ptrace::detach(tid, None).is_err() {
                session.linger_dead();
            }
            return Err(ptrace_err("interrupt")(errno));
        }
        session.wait_for_interrupt()?;
        borrower.count(|c| c.borrows += 1);
        // Stopped: is it still the process that was opened, running the same program?
        if process.has_exited() {
            session.release()?;
            return Err(RemoteError::Gone(pid));
        }
        let regs = arch::get(tid).map_err(ptrace_err("getregs"))?;
        if !arch::is_64bit(&regs) {
            session.release()?;
            return Err(RemoteError::Refused {
                pid,
                reason: RemoteRefusal::Compat,
            });
        }
        // Before anything runs in the thread: an ip inside an rseq critical section goes to
        // the section's abort handler, as the kernel would send it (see `rseq`).
        let mut regs = regs;
        let abort = ProcMem::open(pid)
            .map_err(|_| RemoteError::Gone(pid))
            .and_then(|mem| {
                rseq::abort_target(&mem, tid, arch::ip(&regs))
                    .map_err(|source| RemoteError::Rseq { pid, source })
            });
        match abort {
            Ok(Some(abort_ip)) => {
                arch::set_ip(&mut regs, abort_ip);
                borrower.count(|c| c.rseq_aborts += 1);
            }
            Ok(None) => {}
            Err(e) => {
                session.release()?;
                return Err(e);
            }
        }
        let mask = sigmask(tid, None).map_err(ptrace_err("getsigmask"))?;
        session.saved_mask = Some(mask);
        session.saved = Some(regs);
        // Stopped, the thread can no longer exec; but it may have before we stopped it, and
        // then the vDSO address and every address the caller scanned are stale.
        if process.has_new_image() {
            session.release()?;
            return Err(RemoteError::NewImage(pid));
        }
        session.settle_interrupted_call();
        // A process running as root that made itself non-dumpable (sshd's privileged
        // children, agents holding keys) shows it nowhere in /proc, whose files are root's
        // either way: it is asked, before anything else is done in it.
        let dumpable = session.syscall(libc::SYS_prctl as u64, &[libc::PR_GET_DUMPABLE as u64])?;
        if dumpable == 0 {
            session.release()?;
            return Err(RemoteError::Refused {
                pid,
                reason: RemoteRefusal::NonDumpable,
            });
        }
        Ok(session)
    }

    /// If the interrupt cut a call short with EINTR: an `epoll_wait` with no timeout is
    /// entered again when the thread is let go (it would have gone on waiting: nothing
    /// changes for it), unless a signal handler is to run then, in which case it returns
    /// EINTR as it would have; anything else is counted in [`super::BorrowCounters::eintr_risk`].
    fn settle_interrupted_call(&mut self) {
        let Some(regs) = self.saved.as_mut() else {
            return;
        };
        let (nr, result) = arch::interrupted_call(regs);
        if result != -i64::from(libc::EINTR) || nr < 0 {
            return;
        }
        let mut code = [0u8; 2];
        let site = arch::call_site(regs);
        let is_syscall = ProcMem::open(self.pid)
            .is_ok_and(|mem| mem.read_at(site, &mut code) && code == arch::SYSCALL);
        let timeout = arch::arg4(regs);
        let waits_forever = match nr {
            libc::SYS_epoll_wait | libc::SYS_epoll_pwait => (timeout as i32) < 0,
            libc::SYS_epoll_pwait2 => timeout == 0,
            _ => false,
        };
        // A timed wait whose entry the wait watch saw: entered again until the time it was
        // due to end (rounded up to the millisecond, never earlier), or, if that has passed,
        // ended as the kernel would have ended it, with no event.
        let timed =
            matches!(nr, libc::SYS_epoll_wait | libc::SYS_epoll_pwait) && (timeout as i32) > 0;
        let entered = CALL_ENTRY
            .get()
            .filter(|_| timed && is_syscall)
            .and_then(|entry| entry(self.pid, self.tid.as_raw() as u32));
        if is_syscall && waits_forever {
            arch::restart(regs);
        } else if let Some(entered) = entered {
            let due = entered + (timeout as i32) as u64 * 1_000_000;
            let now = monotonic_ns();
            match due.checked_sub(now) {
                Some(left) if left > 0 => {
                    arch::set_arg4(regs, left.div_ceil(1_000_000));
                    arch::restart(regs);
                }
                _ => arch::set_result(regs, 0),
            }
            self.borrower.count(|c| c.timed_restarts += 1);
        } else {
            self.borrower.count(|c| c.eintr_risk += 1);
            log::debug!(
                "pid {}: a borrow interrupted call {nr} with EINTR",
                self.pid
            );
        }
    }

    /// The process whose thread is borrowed.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// System calls made in this session.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Runs system call `number` with `args` in the target and returns its raw result
    /// (negative errno on failure, as the kernel returns it).
    pub fn syscall(&mut self, number: u64, args: &[u64]) -> Result<i64, RemoteError> {
        let pid = self.pid;
        let err = |op| ptrace_error(pid, op);
        let (Some(saved), Some(mask)) = (self.saved, self.saved_mask) else {
            return Err(RemoteError::Gone(pid));
        };
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        let regs = arch::call(&saved, self.syscall_at, number, a);
        for _ in 0..CALL_ATTEMPTS {
            // The call's registers and a full mask only for the step: between calls, while
            // rksm does anything else, the thread holds its own, so that if rksm dies there
            // (the kernel then lets the thread go as it is) nothing of the borrow is left.
            arch::set(self.tid, regs).map_err(err("setregs"))?;
            sigmask(self.tid, Some(!0)).map_err(err("setsigmask"))?;
            ptrace::step(self.tid, None).map_err(err("singlestep"))?;
            self.wait_for_step()?;
            let after = arch::get(self.tid).map_err(err("getregs"))?;
            arch::set(self.tid, saved).map_err(err("setregs"))?;
            sigmask(self.tid, Some(mask)).map_err(err("setsigmask"))?;
            if let Some(result) = arch::result(&after, self.syscall_at, number) {
                self.calls += 1;
                return Ok(result);
            }
        }
        Err(RemoteError::Unsettled(pid))
    }

    /// Gives the thread up: it did not stop by `deadline`. It is let go, with what was
    /// changed put back, when it does ([`Borrower::reap_lingering`]).
    fn linger(&mut self, deadline: Duration) -> RemoteError {
        self.released = true;
        let restore = self.saved.map(|regs| (regs, self.saved_mask));
        self.borrower.linger(self.tid, restore);
        RemoteError::NoStop {
            pid: self.pid,
            tid: self.tid.as_raw(),
            deadline,
        }
    }

    /// The thread could not be let go (it is dying, or not in a stop): it stays seized until
    /// [`Borrower::reap_lingering`] takes its exit or its next stop, with nothing to restore.
    fn linger_dead(&mut self) {
        self.borrower.linger(self.tid, None);
    }

    fn gone(&mut self) -> RemoteError {
        self.released = true;
        RemoteError::Gone(self.pid)
    }

    /// Waits for the interrupt's stop. A signal that arrives first is handed back at once
    /// with its siginfo, as compel does; a job-control stop means the process is being
    /// stopped, and it is left to it.
    fn wait_for_interrupt(&mut self) -> Result<(), RemoteError> {
        let deadline = Instant::now() + STOP_DEADLINE;
        let ptrace_err = |pid, op, errno| RemoteError::Ptrace { pid, op, errno };
        loop {
            match wait_until(self.tid, deadline).map_err(|e| ptrace_err(self.pid, "waitpid", e))? {
                None => return Err(self.linger(STOP_DEADLINE)),
                Some(Stop::Interrupted(libc::SIGTRAP)) => return Ok(()),
                Some(Stop::Interrupted(_)) => {
                    // A group stop (SIGSTOP, SIGTSTP): detaching leaves it stopped, as
                    // job control wants.
                    self.release()?;
                    return Err(RemoteError::Refused {
                        pid: self.pid,
                        reason: RemoteRefusal::Stopped,
                    });
                }
                Some(Stop::Signal(sig)) => resume_with(libc::PTRACE_CONT, self.tid, sig)
                    .map_err(|e| ptrace_err(self.pid, "cont", e))?,
                Some(Stop::Event) => {
                    ptrace::cont(self.tid, None).map_err(|e| ptrace_err(self.pid, "cont", e))?
                }
                Some(Stop::Gone) => return Err(self.gone()),
            }
        }
    }

    /// Waits for the single step's stop. Every signal is blocked; one that cannot be (a
    /// SIGSTOP) is kept to be sent again, and the caller sees the call did not complete.
    fn wait_for_step(&mut self) -> Result<(), RemoteError> {
        let deadline = Instant::now() + CALL_DEADLINE;
        let stop = wait_until(self.tid, deadline).map_err(|errno| RemoteError::Ptrace {
            pid: self.pid,
            op: "waitpid",
            errno,
        })?;
        match stop {
            None => Err(self.linger(CALL_DEADLINE)),
            Some(Stop::Gone) => Err(self.gone()),
            Some(Stop::Signal(libc::SIGSTOP)) => {
                self.stop_signal = true;
                Ok(())
            }
            Some(_) => Ok(()),
        }
    }

    /// Restores the registers and signal mask and lets the thread go.
    pub fn finish(mut self) -> Result<u64, RemoteError> {
        self.release()?;
        Ok(self.calls)
    }

    fn release(&mut self) -> Result<(), RemoteError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let pid = self.pid;
        let err = |op| ptrace_error(pid, op);
        let restored = match self.saved {
            Some(saved) => arch::set(self.tid, saved).map_err(err("setregs")),
            None => Ok(()),
        };
        let unmasked = match self.saved_mask {
            Some(mask) => sigmask(self.tid, Some(mask))
                .map(drop)
                .map_err(err("setsigmask")),
            None => Ok(()),
        };
        let detached = ptrace::detach(self.tid, None).map_err(err("detach"));
        if detached.is_err() {
            // Killed while held (the detach fails once it is not in a ptrace stop): its exit
            // is reported to rksm first, and until rksm takes that report its parent cannot
            // reap it. It is taken with the lingering ones.
            self.linger_dead();
        }
        if self.stop_signal {
            // SAFETY: tgkill takes plain integers.
            unsafe {
                libc::syscall(
                    libc::SYS_tgkill,
                    self.pid as i32,
                    self.tid.as_raw(),
                    libc::SIGSTOP,
                )
            };
        }
        restored.and(unmasked).and(detached)
    }
}

impl Drop for RemoteSession<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            log::warn!("letting go of pid {}: {e}", self.pid);
        }
    }
}
