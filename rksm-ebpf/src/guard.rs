//! The userfaultfd guard (see `rksm_common::uffd_guard`): a target that takes up userfaultfd
//! while rksm holds one over its memory gets it, because rksm gives its own up first.
//!
//! Both programs cost one hash lookup for any other process. The hold is a bounded loop at
//! the entry of the target's `UFFDIO_REGISTER`, before the kernel takes any lock: the thread
//! waits, the rest of the system runs, and the daemon's reaction (a wakeup and a close) is
//! tens of microseconds.

use aya_ebpf::{
    bindings::BPF_RB_FORCE_WAKEUP,
    helpers::{bpf_ktime_get_ns, bpf_loop},
    macros::{map, tracepoint},
    maps::{HashMap, RingBuf},
    programs::TracePointContext,
    EbpfContext,
};
use rksm_common::{uffd_guard::*, MAX_TRACKED};

#[map(name = "RKSM_UFFD_HELD")]
static HELD: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TRACKED, 0);

#[map(name = "RKSM_UFFD_CLAIMS")]
static CLAIMS: RingBuf = RingBuf::with_byte_size(CLAIM_RING_BYTES, 0);

#[tracepoint(category = "syscalls", name = "sys_enter_userfaultfd")]
pub fn rksm_uffd_create(ctx: TracePointContext) -> u32 {
    let tgid = ctx.tgid();
    if HELD.get_ptr(tgid).is_some() {
        claim(tgid);
    }
    0
}

#[tracepoint(category = "syscalls", name = "sys_enter_ioctl")]
pub fn rksm_uffd_ioctl(ctx: TracePointContext) -> u32 {
    let tgid = ctx.tgid();
    if HELD.get_ptr(tgid).is_none() {
        return 0;
    }
    // SAFETY: the offset is the tracepoint format's, which the daemon checks before loading;
    // bpf_probe_read_kernel fails cleanly on a bad read.
    let Ok(cmd) = (unsafe { ctx.read_at::<u64>(IOCTL_CMD_OFFSET) }) else {
        return 0;
    };
    match cmd as u32 {
        USERFAULTFD_IOC_NEW | UFFDIO_API => claim(tgid),
        UFFDIO_REGISTER => {
            claim(tgid);
            hold(tgid);
        }
        _ => {}
    }
    0
}

/// Tells the daemon `tgid` takes up userfaultfd.
#[inline(always)]
fn claim(tgid: u32) {
    if let Some(mut entry) = CLAIMS.reserve::<u32>(0) {
        entry.write(tgid);
        entry.submit(BPF_RB_FORCE_WAKEUP as u64);
    }
}

/// What one turn of the hold looks at.
#[repr(C)]
struct Hold {
    tgid: u32,
    deadline: u64,
}

/// Waits until the daemon let go of `tgid`, or [`MAX_HOLD_NS`] passed.
#[inline(always)]
fn hold(tgid: u32) {
    let mut wait = Hold {
        tgid,
        // SAFETY: a helper without arguments.
        deadline: unsafe { bpf_ktime_get_ns() } + MAX_HOLD_NS,
    };
    // SAFETY: the callback is a static function of this program and its context a pointer
    // to the stack of this frame, which outlives the loop.
    unsafe { bpf_loop(1 << 23, still_held as *mut _, &raw mut wait as *mut _, 0) };
}

/// One turn: 1 (stop) once the daemon deleted the entry or the deadline passed.
extern "C" fn still_held(_index: u64, wait: *mut Hold) -> i64 {
    // SAFETY: `wait` is the `Hold` that `hold` passed, on its stack.
    let wait = unsafe { &*wait };
    // SAFETY: a helper without arguments.
    let late = unsafe { bpf_ktime_get_ns() } > wait.deadline;
    (late || HELD.get_ptr(wait.tgid).is_none()) as i64
}
