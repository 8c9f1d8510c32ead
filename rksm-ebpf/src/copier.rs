//! The copier (see `rksm_common::copy`): whole pages of a batch of physical frames, read
//! through the kernel's direct map into slots of a map mapped into user space. Never
//! attached: the benchmarks that weigh it against `process_vm_readv` run it with
//! `BPF_PROG_TEST_RUN`, the direct map's start found by the sampler. The daemon does not.

use core::ptr::null_mut;

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    helpers::{bpf_loop, bpf_probe_read_kernel_buf},
    macros::{map, raw_tracepoint},
    maps::Array,
    programs::RawTracePointContext,
};
use rksm_common::{copy::*, PAGE};

#[map(name = "RKSM_COPY_JOB")]
static JOB: Array<CopyJob> = Array::with_max_entries(1, BPF_F_MMAPABLE);

#[map(name = "RKSM_COPY_PAGES")]
static PAGES: Array<[u8; PAGE]> = Array::with_max_entries(SLOTS, BPF_F_MMAPABLE);

/// Copies the job's `count` frames. aya's macro returns 0 to the kernel whatever this
/// returns: the daemon reads the job's `copied` flags.
#[raw_tracepoint(tracepoint = "rksm_copy")]
pub fn rksm_copy(_ctx: RawTracePointContext) -> i32 {
    let Some(job) = JOB.get_ptr(0) else {
        return 0;
    };
    // SAFETY: a pointer into the map's one value, which the lookup just checked.
    let count = unsafe { (*job).count }.min(BATCH as u32);
    // SAFETY: the callback is a static function of this program; it takes no context.
    unsafe { bpf_loop(count, copy_page as *mut _, null_mut(), 0) };
    0
}

/// Page `index` of the batch into its slot.
extern "C" fn copy_page(index: u64, _: *mut u8) -> i64 {
    let Some(job) = JOB.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: the map's one value, checked above.
    let job = unsafe { &mut *job };
    let i = index as usize & (BATCH - 1);
    job.copied[i] = 0;
    let Some(slot) = PAGES.get_ptr_mut(job.first.wrapping_add(i as u32)) else {
        return 1;
    };
    let page = job.base.wrapping_add(job.pfns[i] << 12);
    // SAFETY: a slot of the pages' map, checked by the lookup; bpf_probe_read_kernel fails
    // cleanly on an address it cannot read.
    let read = unsafe { bpf_probe_read_kernel_buf(page as *const u8, &mut *slot) };
    job.copied[i] = u8::from(read.is_ok());
    0
}
