//! The registers of a borrowed thread, and how a system call is made with them: the only
//! architecture-specific part of borrowing, kept apart from the session's logic as compel
//! keeps its arch code. Only x86_64 is implemented: elsewhere
//! [`super::RemoteSession::begin`] refuses with [`super::RemoteError::Unsupported`], and
//! everything that needs no borrowed thread still works.

pub use imp::*;

#[cfg(target_arch = "x86_64")]
mod imp {
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
mod imp {
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
