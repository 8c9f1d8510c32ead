//! The mark watch (see `rksm_common::marks`): which processes asked the kernel to make
//! memory mergeable since the daemon last looked. Two compares for any other call.

use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
    EbpfContext,
};
use rksm_common::marks::*;

#[map(name = "RKSM_MARKERS")]
static MARKERS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(MAX_MARKERS, 0);

#[tracepoint(category = "syscalls", name = "sys_enter_madvise")]
pub fn rksm_mark_madvise(ctx: TracePointContext) -> u32 {
    // SAFETY: the offset is the tracepoint format's, which the daemon checks before loading;
    // bpf_probe_read_kernel fails cleanly on a bad read.
    if let Ok(behavior) = unsafe { ctx.read_at::<u64>(MADVISE_BEHAVIOR_OFFSET) } {
        if behavior as u32 as u64 == MADV_MERGEABLE {
            marked(&ctx);
        }
    }
    0
}

#[tracepoint(category = "syscalls", name = "sys_enter_prctl")]
pub fn rksm_mark_prctl(ctx: TracePointContext) -> u32 {
    // SAFETY: as above.
    let read = |offset| unsafe { ctx.read_at::<u64>(offset) };
    if let (Ok(option), Ok(arg2)) = (read(PRCTL_OPTION_OFFSET), read(PRCTL_ARG2_OFFSET)) {
        if option as u32 as u64 == PR_SET_MEMORY_MERGE && arg2 != 0 {
            marked(&ctx);
        }
    }
    0
}

#[inline(always)]
fn marked(ctx: &TracePointContext) {
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let _ = MARKERS.insert(ctx.tgid(), now, 0);
}
