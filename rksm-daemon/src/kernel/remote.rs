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
//! which might kill them for our call, stopped, in uninterruptible sleep) are refused
//! before anything is done to them.

use std::{fmt, fs};

use nix::{
    errno::Errno,
    sys::{
        ptrace,
        signal::Signal,
        wait::{waitpid, WaitPidFlag, WaitStatus},
    },
    unistd::Pid,
};

use crate::kernel::{process::Process, procfs, reader::ProcMem};

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

/// The registers of a borrowed thread, and how a system call is made with them. Only x86_64
/// is implemented: elsewhere [`RemoteSession::begin`] refuses with
/// [`RemoteError::Unsupported`], and everything that needs no borrowed thread still works.
#[cfg(target_arch = "x86_64")]
mod arch {
    use nix::{sys::ptrace, unistd::Pid};

    /// The saved registers.
    pub type Regs = nix::libc::user_regs_struct;
    /// The `syscall` instruction.
    pub const SYSCALL: [u8; 2] = [0x0f, 0x05];

    pub fn get(tid: Pid) -> nix::Result<Regs> {
        ptrace::getregs(tid)
    }

    pub fn set(tid: Pid, regs: Regs) -> nix::Result<()> {
        ptrace::setregs(tid, regs)
    }

    /// `saved`, pointed at the `syscall` instruction at `at` with `number` and `args`.
    pub fn call(saved: &Regs, at: u64, number: u64, args: [u64; 6]) -> Regs {
        let mut regs = *saved;
        regs.rip = at;
        regs.rax = number;
        // Not inside a system call as far as the kernel's restart logic is concerned.
        regs.orig_rax = u64::MAX;
        (regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9) =
            (args[0], args[1], args[2], args[3], args[4], args[5]);
        regs
    }

    /// The call's result, if the thread stepped over the instruction at `at` (a signal can
    /// stop it before it executes the instruction: then the call is made again).
    pub fn result(after: &Regs, at: u64) -> Option<i64> {
        (after.rip == at + SYSCALL.len() as u64).then_some(after.rax as i64)
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod arch {
    use nix::unistd::Pid;

    pub type Regs = ();
    pub const SYSCALL: [u8; 2] = [0, 0];

    pub fn get(_tid: Pid) -> nix::Result<Regs> {
        Err(nix::errno::Errno::ENOSYS)
    }

    pub fn set(_tid: Pid, _regs: Regs) -> nix::Result<()> {
        Err(nix::errno::Errno::ENOSYS)
    }

    pub fn call(_saved: &Regs, _at: u64, _number: u64, _args: [u64; 6]) -> Regs {}

    pub fn result(_after: &Regs, _at: u64) -> Option<i64> {
        None
    }
}

/// Why a target cannot be borrowed for remote system calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RemoteRefusal {
    /// Another tracer (a debugger, strace) is attached.
    Traced,
    /// Seccomp (strict mode or a filter) could kill the process for a call it does not expect.
    Seccomp,
    /// The process is stopped (SIGSTOP, job control); resuming it would be a surprise.
    Stopped,
    /// The thread is in uninterruptible sleep; waiting for it could block rksm.
    UninterruptibleSleep,
    /// No `syscall` instruction in its vDSO (no vDSO, or an unexpected one).
    NoVdso,
}

impl RemoteRefusal {
    /// Whether the reason lasts as long as the process (seccomp cannot be turned off); the
    /// others can pass: a tracer detaches, a stop or a disk wait ends, and a process caught
    /// in the middle of an exec has no vDSO mapped for a moment.
    pub fn is_lasting(self) -> bool {
        matches!(self, RemoteRefusal::Seccomp)
    }

    /// Stable short name, used as a counter label.
    pub fn as_str(self) -> &'static str {
        match self {
            RemoteRefusal::Traced => "traced",
            RemoteRefusal::Seccomp => "seccomp",
            RemoteRefusal::Stopped => "stopped",
            RemoteRefusal::UninterruptibleSleep => "uninterruptible_sleep",
            RemoteRefusal::NoVdso => "no_vdso",
        }
    }
}

impl fmt::Display for RemoteRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RemoteRefusal::Traced => "it is already being traced",
            RemoteRefusal::Seccomp => "it runs under seccomp",
            RemoteRefusal::Stopped => "it is stopped",
            RemoteRefusal::UninterruptibleSleep => "it is in uninterruptible sleep",
            RemoteRefusal::NoVdso => "it has no vDSO syscall instruction to borrow",
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
        } else if self.state == 'D' {
            Some(RemoteRefusal::UninterruptibleSleep)
        } else {
            None
        }
    }
}

/// Checks whether `pid` can be borrowed, without touching it.
pub fn check_borrowable(pid: u32) -> Result<(), RemoteError> {
    let status =
        fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| RemoteError::Gone(pid))?;
    match BorrowStatus::parse(&status).and_then(|s| s.refusal()) {
        Some(reason) => Err(RemoteError::Refused { pid, reason }),
        None => Ok(()),
    }
}

/// Finds a `syscall` instruction (0f 05) in the process's vDSO.
fn vdso_syscall_instruction(pid: u32) -> Result<u64, RemoteError> {
    let no_vdso = RemoteError::Refused {
        pid,
        reason: RemoteRefusal::NoVdso,
    };
    let vmas = procfs::read_maps(pid).map_err(|_| RemoteError::Gone(pid))?;
    let vdso = vmas.iter().find(|v| v.name == "[vdso]").ok_or(no_vdso)?;
    let mem = ProcMem::open(pid).map_err(|_| RemoteError::Gone(pid))?;
    let mut code = vec![0u8; (vdso.end - vdso.start) as usize];
    for (i, page) in code.chunks_mut(4096).enumerate() {
        if !mem.read_page(vdso.start + i as u64 * 4096, page) {
            return Err(RemoteError::Refused {
                pid,
                reason: RemoteRefusal::NoVdso,
            });
        }
    }
    code.windows(2)
        .position(|w| w == arch::SYSCALL)
        .map(|offset| vdso.start + offset as u64)
        .ok_or(RemoteError::Refused {
            pid,
            reason: RemoteRefusal::NoVdso,
        })
}

/// One thread of a target, stopped and borrowed for system calls. Dropping the session
/// restores the thread's registers and lets it go; [`RemoteSession::finish`] does the same
/// and reports errors.
pub struct RemoteSession {
    pid: u32,
    tid: Pid,
    /// The thread's registers when it stopped; `None` until they were read, and then nothing
    /// is written back.
    saved: Option<arch::Regs>,
    syscall_at: u64,
    /// Signals that arrived while we held the thread, to hand back when we let it go.
    pending: Vec<Signal>,
    calls: u64,
    released: bool,
}

impl RemoteSession {
    /// Stops one thread of `process` (its main thread) and saves its registers.
    pub fn begin(process: &Process) -> Result<Self, RemoteError> {
        if !cfg!(target_arch = "x86_64") {
            return Err(RemoteError::Unsupported);
        }
        let pid = process.pid();
        check_borrowable(pid)?;
        let syscall_at = vdso_syscall_instruction(pid)?;
        let tid = Pid::from_raw(pid as i32);
        let ptrace_err = |op| {
            move |errno| match errno {
                Errno::ESRCH => RemoteError::Gone(pid),
                errno => RemoteError::Ptrace { pid, op, errno },
            }
        };
        // Seize rather than attach: no SIGSTOP is sent, so nothing the target or its parent
        // can observe happens.
        ptrace::seize(tid, ptrace::Options::empty()).map_err(ptrace_err("seize"))?;
        let mut session = RemoteSession {
            pid,
            tid,
            saved: None,
            syscall_at,
            pending: Vec::new(),
            calls: 0,
            released: false,
        };
        if let Err(errno) = ptrace::interrupt(tid) {
            session.released = true;
            let _ = ptrace::detach(tid, None);
            return Err(ptrace_err("interrupt")(errno));
        }
        session.wait_for_stop(false)?;
        session.saved = Some(arch::get(tid).map_err(ptrace_err("getregs"))?);
        // Stopped, the thread can no longer exec; but it may have before we stopped it, and
        // then the vDSO address and every address the caller scanned are stale.
        if process.has_new_image() {
            session.release()?;
            return Err(RemoteError::NewImage(pid));
        }
        Ok(session)
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
        let err = |op| {
            move |errno| match errno {
                Errno::ESRCH => RemoteError::Gone(pid),
                errno => RemoteError::Ptrace { pid, op, errno },
            }
        };
        let saved = self.saved.as_ref().ok_or(RemoteError::Gone(pid))?;
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        let regs = arch::call(saved, self.syscall_at, number, a);
        loop {
            arch::set(self.tid, regs).map_err(err("setregs"))?;
            ptrace::step(self.tid, None).map_err(err("singlestep"))?;
            self.wait_for_stop(true)?;
            let after = arch::get(self.tid).map_err(err("getregs"))?;
            if let Some(result) = arch::result(&after, self.syscall_at) {
                self.calls += 1;
                return Ok(result);
            }
        }
    }

    /// Waits for the borrowed thread's next stop. Signals that arrive meanwhile are kept to
    /// be delivered at the end; `stepping` means a SIGTRAP is our single-step.
    fn wait_for_stop(&mut self, stepping: bool) -> Result<(), RemoteError> {
        loop {
            match waitpid(self.tid, Some(WaitPidFlag::__WALL)) {
                Ok(WaitStatus::Stopped(_, Signal::SIGTRAP)) if stepping => return Ok(()),
                Ok(WaitStatus::PtraceEvent(..)) if !stepping => return Ok(()),
                Ok(WaitStatus::Stopped(_, sig)) => {
                    // A signal-delivery stop: hold the signal back for now.
                    self.pending.push(sig);
                    if !stepping {
                        // The interrupt's own stop still comes; keep the thread moving to it.
                        ptrace::cont(self.tid, None).map_err(|errno| RemoteError::Ptrace {
                            pid: self.pid,
                            op: "cont",
                            errno,
                        })?;
                        continue;
                    }
                    return Ok(());
                }
                Ok(WaitStatus::PtraceEvent(..)) => {
                    ptrace::step(self.tid, None).map_err(|errno| RemoteError::Ptrace {
                        pid: self.pid,
                        op: "singlestep",
                        errno,
                    })?;
                }
                Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..))
                | Err(Errno::ECHILD | Errno::ESRCH) => {
                    self.released = true;
                    return Err(RemoteError::Gone(self.pid));
                }
                Ok(_) => {}
                Err(Errno::EINTR) => {}
                Err(errno) => {
                    return Err(RemoteError::Ptrace {
                        pid: self.pid,
                        op: "waitpid",
                        errno,
                    })
                }
            }
        }
    }

    /// Restores the registers, lets the thread go, and re-delivers held signals.
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
        let err = |op| {
            move |errno| match errno {
                Errno::ESRCH => RemoteError::Gone(pid),
                errno => RemoteError::Ptrace { pid, op, errno },
            }
        };
        let restored = match self.saved {
            Some(saved) => arch::set(self.tid, saved).map_err(err("setregs")),
            None => Ok(()),
        };
        let detached = ptrace::detach(self.tid, None).map_err(err("detach"));
        // Signals held back while we had the thread go to the same thread now; a detach
        // from an event stop would drop a signal passed to it.
        for &sig in &self.pending {
            // SAFETY: tgkill takes plain integers.
            unsafe {
                libc::syscall(
                    libc::SYS_tgkill,
                    self.pid as i32,
                    self.tid.as_raw(),
                    sig as i32,
                )
            };
        }
        restored.and(detached)
    }
}

impl Drop for RemoteSession {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            log::warn!("letting go of pid {}: {e}", self.pid);
        }
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
        assert_eq!(
            refusal(status(0, 0, "D (disk sleep)")),
            Some(RemoteRefusal::UninterruptibleSleep)
        );
        assert_eq!(BorrowStatus::parse("Name:\tx\n"), None);
    }
}
