//! The threads of a target, as ptrace sees them: which one to borrow, where its vDSO's
//! `syscall` instruction is, its signal mask, and waiting for its stops with a deadline.

use std::{
    fs,
    time::{Duration, Instant},
};

use nix::{errno::Errno, unistd::Pid};
use rksm_common::PAGE_SIZE;

use super::{arch, BorrowStatus, RemoteError, RemoteRefusal};
use crate::kernel::{procfs, reader::ProcMem};

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
pub(super) fn choose_thread(pid: u32) -> Result<Pid, RemoteError> {
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
/// program's never does (it is at the top of the 47-bit space). From its /proc/PID/stat
/// (`stat`): opening the executable to read its ELF header would wait with a FUSE server that
/// stopped answering. The registers at the stop say it again, exactly.
pub(super) fn is_32bit_program(stat: &str) -> bool {
    procfs::stat_field(stat, 28)
        .and_then(|start| start.parse::<u64>().ok())
        .is_some_and(|start_stack| start_stack != 0 && start_stack < 1 << 32)
}

/// Finds a `syscall` instruction (0f 05) in the process's vDSO.
pub(super) fn vdso_syscall_instruction(pid: u32) -> Result<u64, RemoteError> {
    let no_vdso = RemoteError::Refused {
        pid,
        reason: RemoteRefusal::NoVdso,
    };
    let vmas = procfs::read_maps(pid).map_err(|_| RemoteError::Gone(pid))?;
    let vdso = vmas.iter().find(|v| v.name == "[vdso]").ok_or(no_vdso)?;
    let mem = ProcMem::open(pid).map_err(|_| RemoteError::Gone(pid))?;
    let mut code = vec![0u8; (vdso.end - vdso.start) as usize];
    for (i, page) in code.chunks_mut(PAGE_SIZE as usize).enumerate() {
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

pub(super) fn sigmask(tid: Pid, set: Option<u64>) -> nix::Result<u64> {
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

/// What `waitpid` said about a traced thread. Decoded here rather than by nix, whose
/// `Signal` has no real-time signals: a thread stopped for SIGRTMIN must still be understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
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
pub(super) fn poll_stop(tid: Pid) -> Result<Option<Stop>, Errno> {
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
pub(super) fn wait_until(tid: Pid, deadline: Instant) -> Result<Option<Stop>, Errno> {
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
pub(super) fn resume_with(request: libc::c_uint, tid: Pid, signal: i32) -> nix::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
