//! Restartable sequences of a stopped thread: where the kernel would abort one, so does rksm.
//!
//! A thread may be stopped for a borrow in the middle of an rseq critical section (tcmalloc's
//! and librseq's per-CPU updates, glibc registers an rseq area in every thread). Had the
//! kernel preempted it there, it would move the thread to the section's abort handler on its
//! way back to user space. A borrow runs the thread at the vDSO first: the kernel then finds
//! it outside the section and merely forgets the section, and restoring the saved
//! instruction pointer afterwards would let the section commit after a preemption, on data
//! another thread changed meanwhile. So, as CRIU's compel does, the stop is settled first: an
//! instruction pointer inside the registered section moves to its abort handler, exactly as
//! the kernel's `rseq_ip_fixup` would move it.

use nix::{errno::Errno, unistd::Pid};

use crate::kernel::reader::ProcMem;

/// `PTRACE_GET_RSEQ_CONFIGURATION` (linux/ptrace.h, Linux 5.13).
const PTRACE_GET_RSEQ_CONFIGURATION: libc::c_uint = 0x420f;

/// `struct ptrace_rseq_configuration`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Configuration {
    rseq_abi_pointer: u64,
    rseq_abi_size: u32,
    signature: u32,
    flags: u32,
    pad: u32,
}

/// Offset of `rseq_cs` (the current critical section's descriptor) in `struct rseq`.
const RSEQ_CS_OFFSET: u64 = 8;

/// Errors of reading a thread's rseq state.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RseqError {
    /// `PTRACE_GET_RSEQ_CONFIGURATION` failed for a reason other than an old kernel.
    #[error("PTRACE_GET_RSEQ_CONFIGURATION: {0}")]
    Ptrace(Errno),
    /// The registered area or the section's descriptor could not be read.
    #[error("its rseq area at {0:#x} cannot be read")]
    Unreadable(u64),
    /// The thread is inside a section the kernel would reject (wrong version, an abort
    /// handler inside the section or without the registered signature): the kernel kills
    /// such a thread with SIGSEGV at its next preemption; rksm does not touch it.
    #[error("it is inside an rseq critical section the kernel would reject")]
    Invalid,
}

/// `struct rseq_cs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CriticalSection {
    version: u32,
    start_ip: u64,
    post_commit_offset: u64,
    abort_ip: u64,
}

impl CriticalSection {
    fn parse(raw: &[u8; 32]) -> Self {
        let word = |at: usize| u64::from_ne_bytes(raw[at..at + 8].try_into().expect("8 bytes"));
        CriticalSection {
            version: u32::from_ne_bytes(raw[0..4].try_into().expect("4 bytes")),
            start_ip: word(8),
            post_commit_offset: word(16),
            abort_ip: word(24),
        }
    }

    /// The kernel's `in_rseq_cs`: unsigned, so an ip below the start is outside.
    fn contains(&self, ip: u64) -> bool {
        ip.wrapping_sub(self.start_ip) < self.post_commit_offset
    }
}

/// The registered rseq area of stopped thread `tid`: `None` where it has none, or where the
/// kernel cannot say (before 5.13).
fn configuration(tid: Pid) -> Result<Option<Configuration>, RseqError> {
    let mut config = Configuration::default();
    // SAFETY: the request writes at most `size` bytes (the size passed as addr) to `data`,
    // which points to a `Configuration` of exactly that size.
    let r = unsafe {
        libc::ptrace(
            PTRACE_GET_RSEQ_CONFIGURATION,
            tid.as_raw(),
            std::mem::size_of::<Configuration>(),
            &mut config as *mut Configuration,
        )
    };
    match Errno::result(r) {
        Ok(_) if config.rseq_abi_pointer != 0 => Ok(Some(config)),
        Ok(_) => Ok(None),
        // Kernels before 5.13 do not know the request.
        Err(Errno::EIO | Errno::EINVAL) => Ok(None),
        Err(errno) => Err(RseqError::Ptrace(errno)),
    }
}

/// Where stopped thread `tid` of the process behind `mem` must resume for its rseq state to
/// be what the kernel would make it: `Some(abort_ip)` if `ip` is inside its current critical
/// section, `None` if there is nothing to change.
pub fn abort_target(mem: &ProcMem, tid: Pid, ip: u64) -> Result<Option<u64>, RseqError> {
    let Some(config) = configuration(tid)? else {
        return Ok(None);
    };
    let mut word = [0u8; 8];
    let area = config.rseq_abi_pointer;
    if !mem.read_at(area + RSEQ_CS_OFFSET, &mut word) {
        return Err(RseqError::Unreadable(area));
    }
    let descriptor = u64::from_ne_bytes(word);
    if descriptor == 0 {
        return Ok(None);
    }
    let mut raw = [0u8; 32];
    if !mem.read_at(descriptor, &mut raw) {
        return Err(RseqError::Unreadable(descriptor));
    }
    let cs = CriticalSection::parse(&raw);
    if !cs.contains(ip) {
        return Ok(None);
    }
    let mut signature = [0u8; 4];
    let valid = cs.version == 0
        && !cs.contains(cs.abort_ip)
        && cs.abort_ip >= 4
        && mem.read_at(cs.abort_ip - 4, &mut signature)
        && u32::from_ne_bytes(signature) == config.signature;
    if valid {
        Ok(Some(cs.abort_ip))
    } else {
        Err(RseqError::Invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(start: u64, len: u64, abort: u64) -> CriticalSection {
        let mut raw = [0u8; 32];
        raw[8..16].copy_from_slice(&start.to_ne_bytes());
        raw[16..24].copy_from_slice(&len.to_ne_bytes());
        raw[24..32].copy_from_slice(&abort.to_ne_bytes());
        CriticalSection::parse(&raw)
    }

    #[test]
    fn the_section_is_its_start_up_to_the_commit_excluded() {
        let cs = section(0x1000, 0x20, 0x2000);
        assert_eq!(cs.version, 0);
        assert!(!cs.contains(0xfff), "below the start");
        assert!(cs.contains(0x1000));
        assert!(cs.contains(0x101f));
        assert!(!cs.contains(0x1020), "the instruction after the commit");
        assert!(!section(0x1000, 0, 0).contains(0x1000), "an empty section");
    }
}
