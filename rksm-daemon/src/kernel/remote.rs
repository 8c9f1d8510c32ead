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
//! and mask restored if they were changed) as soon as it does stop ([`reap_lingering`]).
//!
//! The thread borrowed is the one least likely to notice: one running in user space, or
//! asleep in a call the kernel restarts by itself, before one asleep in a call that returns
//! EINTR when interrupted (`epoll_wait`, socket calls with timeouts, SysV IPC, io_uring). If
//! such a call was interrupted anyway, an `epoll_wait` or `epoll_pwait` is handed back to the
//! kernel as a call to restart (`-ERESTARTNOHAND`: it returns EINTR only if a signal handler
//! runs, as it would have), with the time it had left if it had a timeout and its entry was
//! seen ([`set_call_entry`]); any other is counted in [`eintr_risk`].

use std::{
    fmt, fs,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, OnceLock,
    },
    time::{Duration, Instant},
};

use nix::{errno::Errno, sys::ptrace, unistd::Pid};
use rksm_common::PAGE_SIZE;

use crate::kernel::{
    oom,
    process::Process,
    procfs,
    reader::ProcMem,
    rseq::{self, RseqError},
};

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
const CALL_ATTEMPTS: u32 = 4;

/// Borrows whose thread came back from an interrupted call with EINTR that rksm could not
/// restart: the target may have noticed. Process-wide, like the kernel's counters.
static EINTR_RISK: AtomicU64 = AtomicU64::new(0);

/// Threads borrowed (stopped and let go again), process-wide.
static BORROWS: AtomicU64 = AtomicU64::new(0);

/// Where the entry time of a thread's current wait comes from: `(pid, tid)` → CLOCK_MONOTONIC
/// nanoseconds at entry (the eBPF wait watch, when loaded).
static CALL_ENTRY: OnceLock<fn(u32, u32) -> Option<u64>> = OnceLock::new();

/// Waits a borrow cut short that were entered again with the time they had left.
static TIMED_RESTARTS: AtomicU64 = AtomicU64::new(0);

/// Gives the borrow the entry times of the targets' waits, so that a timed `epoll_wait` it
/// interrupts is entered again with the time it had left rather than return EINTR.
pub fn set_call_entry(source: fn(u32, u32) -> Option<u64>) {
    let _ = CALL_ENTRY.set(source);
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of the kernel's timeouts and of
/// `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, `now`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Timed waits a borrow interrupted and entered again with the time they had left.
pub fn timed_restarts() -> u64 {
    TIMED_RESTARTS.load(Ordering::Relaxed)
}

/// Borrowed threads found inside an rseq critical section and sent to its abort handler.
static RSEQ_ABORTS: AtomicU64 = AtomicU64::new(0);

/// Borrowed threads that were inside an rseq critical section, which rksm aborted as the
/// kernel would have.
pub fn rseq_aborts() -> u64 {
    RSEQ_ABORTS.load(Ordering::Relaxed)
}

/// What borrowing did so far, process-wide (see the functions of the same names).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BorrowCounters {
    /// [`borrows`].
    pub borrows: u64,
    /// [`eintr_risk`].
    pub eintr_risk: u64,
    /// [`rseq_aborts`].
    pub rseq_aborts: u64,
    /// [`timed_restarts`].
    pub timed_restarts: u64,
}

impl BorrowCounters {
    /// The counters now.
    pub fn now() -> Self {
        BorrowCounters {
            borrows: borrows(),
            eintr_risk: eintr_risk(),
            rseq_aborts: rseq_aborts(),
            timed_restarts: timed_restarts(),
        }
    }

    /// What was counted since `start`.
    pub fn since(self, start: BorrowCounters) -> Self {
        BorrowCounters {
            borrows: self.borrows - start.borrows,
            eintr_risk: self.eintr_risk - start.eintr_risk,
            rseq_aborts: self.rseq_aborts - start.rseq_aborts,
            timed_restarts: self.timed_restarts - start.timed_restarts,
        }
    }
}

/// Borrows that may have made a target see EINTR (see the module documentation).
pub fn eintr_risk() -> u64 {
    EINTR_RISK.load(Ordering::Relaxed)
}

/// Threads borrowed so far by this process.
pub fn borrows() -> u64 {
    BORROWS.load(Ordering::Relaxed)
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
    /// The user code segment of a 64-bit process (0x23 is compat mode's).
    const USER_CS_64: u64 = 0x33;

    /// True if the thread runs 64-bit code.
    pub fn is_64bit(regs: &Regs) -> bool {
        regs.cs == USER_CS_64
    }

    /// The thread was stopped as an interrupted call returned: which call and its result.
    pub fn interrupted_call(regs: &Regs) -> (i64, i64) {
        (regs.orig_rax as i64, regs.rax as i64)
    }

    /// Where the `syscall` instruction that made the last call is (if it was one).
    pub fn call_site(regs: &Regs) -> u64 {
        regs.rip.wrapping_sub(SYSCALL.len() as u64)
    }

    /// `regs`, made to look like a call the kernel restarts unless a signal handler runs
    /// (-ERESTARTNOHAND): when the thread is let go, the kernel itself either enters the
    /// call again or, if a handler is to run first, makes it return EINTR, as it would
    /// have without rksm.
    pub fn restart(regs: &mut Regs) {
        const ERESTARTNOHAND: i64 = 514;
        regs.rax = (-ERESTARTNOHAND) as u64;
    }

    /// The fourth argument (`epoll_wait`'s timeout).
    pub fn arg4(regs: &Regs) -> u64 {
        regs.r10
    }

    /// Sets the fourth argument, for a call entered again.
    pub fn set_arg4(regs: &mut Regs, value: u64) {
        regs.r10 = value;
    }

    /// Makes the interrupted call return `value`.
    pub fn set_result(regs: &mut Regs, value: i64) {
        regs.rax = value as u64;
    }

    /// The instruction pointer.
    pub fn ip(regs: &Regs) -> u64 {
        regs.rip
    }

    /// Moves the instruction pointer.
    pub fn set_ip(regs: &mut Regs, ip: u64) {
        regs.rip = ip;
    }

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

    /// The call's result, if this stop is the injected call's: the thread stepped over the
    /// instruction at `at`, the kernel ran call `number`, in 64-bit mode. Anything else (a
    /// stop before the instruction ran) means the call is made again.
    pub fn result(after: &Regs, at: u64, number: u64) -> Option<i64> {
        (after.rip == at + SYSCALL.len() as u64 && after.orig_rax == number && is_64bit(after))
            .then_some(after.rax as i64)
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

    pub fn result(_after: &Regs, _at: u64, _number: u64) -> Option<i64> {
        None
    }

    pub fn is_64bit(_regs: &Regs) -> bool {
        false
    }

    pub fn interrupted_call(_regs: &Regs) -> (i64, i64) {
        (-1, 0)
    }

    pub fn call_site(_regs: &Regs) -> u64 {
        0
    }

    pub fn restart(_regs: &mut Regs) {}

    pub fn arg4(_regs: &Regs) -> u64 {
        0
    }

    pub fn set_arg4(_regs: &mut Regs, _value: u64) {}

    pub fn set_result(_regs: &mut Regs, _value: i64) {}

    pub fn ip(_regs: &Regs) -> u64 {
        0
    }

    pub fn set_ip(_regs: &mut Regs, _ip: u64) {}
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

/// System calls that return EINTR, not a restart, when the thread is interrupted (even by
/// a ptrace interrupt, with no signal at all): the event waits, socket calls (with a
/// timeout they return EINTR), SysV and POSIX message queues, semaphores, io_uring and AIO.
const EINTR_CALLS: &[i64] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_recvmmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_msgrcv,
    libc::SYS_msgsnd,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_timedsend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_io_getevents,
    333, // io_pgetevents (not in libc's list)
    libc::SYS_io_uring_enter,
];

/// How much borrowing a thread would disturb it, from its state and /proc/PID/task/TID/syscall
/// (`running`, `-1 ...` outside a call, or `NR args...` asleep in call NR). `None`: it
/// cannot be borrowed now (disk wait, stopped, dying).
pub(crate) fn disturbance(state: char, syscall: &str) -> Option<u8> {
    match state {
        'R' => Some(0),
        'S' => {
            let nr: i64 = syscall.split_whitespace().next()?.parse().unwrap_or(-1);
            Some(if EINTR_CALLS.contains(&nr) { 2 } else { 1 })
        }
        _ => None,
    }
}

/// The thread to borrow: the least disturbed (see [`disturbance`]), the main thread first
/// among equals. Seccomp filters are per thread: one with a filter of its own is never
/// chosen, since the filter could kill the process for the injected call. `Seccomp` if every
/// thread has one, `UninterruptibleSleep` if none can be borrowed now.
fn choose_thread(pid: u32) -> Result<Pid, RemoteError> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).map_err(|_| RemoteError::Gone(pid))?;
    let mut best: Option<(u8, bool, i32)> = None;
    let (mut filtered, mut seen) = (0, 0);
    for tid in tasks
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
    {
        let dir = format!("/proc/{pid}/task/{tid}");
        let (Ok(stat), Ok(syscall), Ok(status)) = (
            procfs::read_text(format!("{dir}/stat")),
            procfs::read_text(format!("{dir}/syscall")),
            procfs::read_text(format!("{dir}/status")),
        ) else {
            continue;
        };
        seen += 1;
        // Unparsable counts as filtered: when in doubt, the thread is left alone.
        if BorrowStatus::parse(&status).is_none_or(|s| s.seccomp != 0) {
            filtered += 1;
            continue;
        }
        let Some(state) = procfs::stat_field(&stat, 3).and_then(|s| s.chars().next()) else {
            continue;
        };
        if let Some(cost) = disturbance(state, &syscall) {
            let key = (cost, tid as u32 != pid, tid);
            if best.is_none_or(|b| key < b) {
                best = Some(key);
            }
        }
    }
    let reason = match filtered {
        n if n > 0 && n == seen => RemoteRefusal::Seccomp,
        _ => RemoteRefusal::UninterruptibleSleep,
    };
    best.map(|(.., tid)| Pid::from_raw(tid))
        .ok_or(RemoteError::Refused { pid, reason })
}

/// True if the program is 32-bit (i386 or x32): its stack starts below 4 GiB, where a 64-bit
/// program's never does (it is at the top of the 47-bit space). From /proc/PID/stat: opening
/// the executable to read its ELF header would wait with a FUSE server that stopped
/// answering. The registers at the stop say it again, exactly.
fn is_32bit_program(pid: u32) -> bool {
    procfs::read_text(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| procfs::stat_field(&stat, 28)?.parse::<u64>().ok())
        .is_some_and(|start_stack| start_stack != 0 && start_stack < 1 << 32)
}

/// Checks whether `pid` can be borrowed, without touching it.
///
/// The daemon asks this of every target every pass, so the threads are looked at one by one
/// only when the main thread is in a disk wait: otherwise the main thread itself could be
/// borrowed, and [`RemoteSession::begin`] picks the best one when it is needed.
pub fn check_borrowable(pid: u32) -> Result<(), RemoteError> {
    let status =
        procfs::read_text(format!("/proc/{pid}/status")).map_err(|_| RemoteError::Gone(pid))?;
    let refused = |reason| Err(RemoteError::Refused { pid, reason });
    let status = BorrowStatus::parse(&status);
    if let Some(reason) = status.as_ref().and_then(BorrowStatus::refusal) {
        return refused(reason);
    }
    if is_32bit_program(pid) {
        return refused(RemoteRefusal::Compat);
    }
    match status {
        Some(s) if s.state == 'D' => choose_thread(pid).map(drop),
        _ => Ok(()),
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
        if !mem.read_page(vdso.start + i as u64 * PAGE_SIZE, page) {
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

/// `PTRACE_GETSIGMASK` / `PTRACE_SETSIGMASK` (linux/ptrace.h).
const PTRACE_GETSIGMASK: libc::c_uint = 0x420a;
const PTRACE_SETSIGMASK: libc::c_uint = 0x420b;

fn sigmask(tid: Pid, set: Option<u64>) -> nix::Result<u64> {
    let (request, mut mask) = match set {
        Some(mask) => (PTRACE_SETSIGMASK, mask),
        None => (PTRACE_GETSIGMASK, 0u64),
    };
    // SAFETY: both requests take the size of a kernel sigset_t (8 bytes on x86_64) and a
    // pointer to one, which `mask` is; the kernel reads or writes exactly that.
    let r = unsafe {
        libc::ptrace(
            request,
            tid.as_raw(),
            std::mem::size_of::<u64>(),
            &mut mask as *mut u64,
        )
    };
    Errno::result(r).map(|_| mask)
}

/// A thread seized but not stopped in time, or stopped mid-call when time ran out: let go
/// (with what it had restored) as soon as it stops.
struct Lingering {
    /// The rksm thread that traces it (only that thread can wait for it).
    tracer: libc::pid_t,
    tid: Pid,
    restore: Option<(arch::Regs, Option<u64>)>,
    /// rksm stays out of the OOM killer's reach while it holds the thread.
    _shield: oom::Shield,
}

static LINGERING: Mutex<Vec<Lingering>> = Mutex::new(Vec::new());

fn gettid() -> libc::pid_t {
    // SAFETY: gettid takes nothing and cannot fail.
    unsafe { libc::gettid() }
}

/// Lets go of threads that stopped since they were given up; returns how many are still
/// waited for. The daemon calls it before every borrow and while it sleeps between passes.
pub fn reap_lingering() -> usize {
    let me = gettid();
    let mut lingering = LINGERING.lock().unwrap_or_else(|e| e.into_inner());
    lingering.retain(|l| {
        if l.tracer != me {
            return true;
        }
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

/// What `waitpid` said about a traced thread. Decoded here rather than by nix, whose
/// `Signal` has no real-time signals: a thread stopped for SIGRTMIN must still be understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// A signal-delivery stop (the single step's is SIGTRAP).
    Signal(i32),
    /// `PTRACE_EVENT_STOP`: the interrupt's (SIGTRAP) or a group stop (the stop signal).
    Interrupted(i32),
    /// Another ptrace event (none is asked for).
    Event,
    /// Exited or killed.
    Gone,
}

/// Waits without blocking for `tid`'s next stop.
fn poll_stop(tid: Pid) -> Result<Option<Stop>, Errno> {
    let mut status = 0;
    // SAFETY: waitpid writes one int, `status`.
    let r = unsafe { libc::waitpid(tid.as_raw(), &mut status, libc::WNOHANG | libc::__WALL) };
    match r {
        0 => Ok(None),
        r if r < 0 => match Errno::last() {
            Errno::EINTR => Ok(None),
            Errno::ECHILD | Errno::ESRCH => Ok(Some(Stop::Gone)),
            errno => Err(errno),
        },
        _ if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) => Ok(Some(Stop::Gone)),
        _ if libc::WIFSTOPPED(status) => {
            let sig = libc::WSTOPSIG(status);
            Ok(Some(match status >> 16 {
                0 => Stop::Signal(sig),
                libc::PTRACE_EVENT_STOP => Stop::Interrupted(sig),
                _ => Stop::Event,
            }))
        }
        _ => Ok(None),
    }
}

/// Polls for `tid`'s next stop until `deadline` (`Ok(None)`: it did not come), sleeping a
/// little longer each time nothing happened.
fn wait_until(tid: Pid, deadline: Instant) -> Result<Option<Stop>, Errno> {
    let mut pause = Duration::from_micros(20);
    loop {
        if let Some(stop) = poll_stop(tid)? {
            return Ok(Some(stop));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}

/// Resumes (`PTRACE_CONT`) or lets go of (`PTRACE_DETACH`) `tid` delivering `signal`, any
/// signal, real-time ones too (its siginfo is the one it came with).
fn resume_with(request: libc::c_uint, tid: Pid, signal: i32) -> nix::Result<()> {
    // SAFETY: PTRACE_CONT and PTRACE_DETACH take the signal number as data, no pointer.
    let r = unsafe {
        libc::ptrace(
            request,
            tid.as_raw(),
            std::ptr::null_mut::<libc::c_void>(),
            signal as libc::c_long,
        )
    };
    Errno::result(r).map(drop)
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
pub struct RemoteSession {
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

impl RemoteSession {
    /// Stops one thread of `process` (the least disturbed, see the module documentation),
    /// saves its registers and blocks its signals.
    pub fn begin(process: &Process) -> Result<Self, RemoteError> {
        if !cfg!(target_arch = "x86_64") {
            return Err(RemoteError::Unsupported);
        }
        let pid = process.pid();
        reap_lingering();
        check_borrowable(pid)?;
        let tid = choose_thread(pid)?;
        let syscall_at = vdso_syscall_instruction(pid)?;
        let ptrace_err = |op| ptrace_error(pid, op);
        let shield = oom::Shield::raise();
        // Seize rather than attach: no SIGSTOP is sent, so nothing the target or its parent
        // can observe happens.
        ptrace::seize(tid, ptrace::Options::empty()).map_err(ptrace_err("seize"))?;
        let mut session = RemoteSession {
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
        BORROWS.fetch_add(1, Ordering::Relaxed);
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
                RSEQ_ABORTS.fetch_add(1, Ordering::Relaxed);
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
    /// EINTR as it would have; anything else is counted in [`eintr_risk`].
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
            TIMED_RESTARTS.fetch_add(1, Ordering::Relaxed);
        } else {
            EINTR_RISK.fetch_add(1, Ordering::Relaxed);
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
    /// changed put back, when it does ([`reap_lingering`]).
    fn linger(&mut self, deadline: Duration) -> RemoteError {
        self.released = true;
        let restore = self.saved.map(|regs| (regs, self.saved_mask));
        LINGERING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Lingering {
                tracer: gettid(),
                tid: self.tid,
                restore,
                _shield: oom::Shield::raise(),
            });
        RemoteError::NoStop {
            pid: self.pid,
            tid: self.tid.as_raw(),
            deadline,
        }
    }

    /// The thread could not be let go (it is dying, or not in a stop): it stays seized until
    /// [`reap_lingering`] takes its exit or its next stop, with nothing to restore.
    fn linger_dead(&mut self) {
        LINGERING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Lingering {
                tracer: gettid(),
                tid: self.tid,
                restore: None,
                _shield: oom::Shield::raise(),
            });
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
        // A disk wait is one thread's: another may be borrowed (see `disturbance`).
        assert_eq!(refusal(status(0, 0, "D (disk sleep)")), None);
        assert_eq!(BorrowStatus::parse("Name:\tx\n"), None);
    }

    #[test]
    fn the_least_disturbed_thread_comes_first() {
        let epoll = format!(
            "{} 0x3 0x7ffd 0x40 0xffffffff 0x0 0x0 0x7ffd 0x7f00",
            libc::SYS_epoll_wait
        );
        let nanosleep = format!(
            "{} 0x0 0x0 0x7ffd 0x0 0x0 0x0 0x7ffd 0x7f00",
            libc::SYS_clock_nanosleep
        );
        let running = disturbance('R', "running").unwrap();
        let restartable = disturbance('S', &nanosleep).unwrap();
        let eintr = disturbance('S', &epoll).unwrap();
        assert!(running < restartable && restartable < eintr);
        assert_eq!(
            disturbance('S', "-1 0x7ffd 0x7f00"),
            Some(restartable),
            "outside a call"
        );
        for unusable in ['D', 'T', 't', 'Z', 'X'] {
            assert_eq!(disturbance(unusable, &nanosleep), None, "{unusable}");
        }
    }
}
