//! The wait watch (see `rksm_common::waits`): when each thread of a target entered its
//! latest `epoll_wait`, so that a wait a borrow cut short is entered again with the time it
//! had left, as the kernel restarts its own timed calls. One hash lookup for any other
//! process.

use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::{map, tracepoint},
    maps::{HashMap, LruHashMap},
    programs::TracePointContext,
    EbpfContext,
};
use rksm_common::{waits::MAX_WAITING_THREADS, MAX_TRACKED};

#[map(name = "RKSM_WAITERS")]
static WAITERS: HashMap<u32, u64> = HashMap::with_max_entries(MAX_TRACKED, 0);

#[map(name = "RKSM_WAIT_ENTERED")]
static ENTERED: LruHashMap<u32, u64> = LruHashMap::with_max_entries(MAX_WAITING_THREADS, 0);

#[tracepoint(category = "syscalls", name = "sys_enter_epoll_wait")]
pub fn rksm_epoll_wait(ctx: TracePointContext) -> u32 {
    entered(&ctx);
    0
}

#[tracepoint(category = "syscalls", name = "sys_enter_epoll_pwait")]
pub fn rksm_epoll_pwait(ctx: TracePointContext) -> u32 {
    entered(&ctx);
    0
}

#[inline(always)]
fn entered(ctx: &TracePointContext) {
    if WAITERS.get_ptr(ctx.tgid()).is_none() {
        return;
    }
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let _ = ENTERED.insert(ctx.pid(), now, 0);
}
