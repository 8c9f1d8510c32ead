//! The sampler (see `rksm_common::sample`): digests of a few bytes of each of a batch of
//! physical pages, read through the kernel's direct map, for the daemon to find which new
//! pages resemble any other before it copies one. Never attached: the daemon runs it with
//! `BPF_PROG_TEST_RUN`. A read that fails (a frame outside the direct map) gives `UNREAD`,
//! and the daemon then reads that page whole.

use core::ptr::{null_mut, read_volatile, write_volatile};

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    helpers::{bpf_loop, bpf_probe_read_kernel},
    macros::{map, raw_tracepoint},
    maps::Array,
    programs::RawTracePointContext,
};
use rksm_common::sample::*;

#[map(name = "RKSM_SAMPLE_JOB")]
static JOB: Array<SampleJob> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// A value the kernel allocates with kmalloc, so in the direct map: the job's is vmalloc'd
/// (an array the daemon maps), and vmalloc's area lies far above the direct map.
#[map(name = "RKSM_SAMPLE_HINT")]
static HINT: Array<u64> = Array::with_max_entries(1, 0);

/// Digests the job's `count` frames into its `digests`, `GROUP` at a time (the daemon
/// gives a multiple of it). aya's macro returns 0 to the kernel whatever this returns: the
/// daemon reads the digests.
#[raw_tracepoint(tracepoint = "rksm_sample")]
pub fn rksm_sample(_ctx: RawTracePointContext) -> i32 {
    let Some(job) = JOB.get_ptr(0) else {
        return -1;
    };
    // SAFETY: a pointer into the map's one value, which the lookup just checked.
    let groups = unsafe { (*job).count }.min(BATCH as u32) / GROUP as u32;
    // SAFETY: the callback is a static function of this program; it takes no context.
    unsafe { bpf_loop(groups, sample_group as *mut _, null_mut(), 0) };
    (groups * GROUP as u32) as i32
}

/// Pages `GROUP * index..` of the batch. A word of each is read first, one page after the
/// other, so that the CPU has their trips to memory in flight at once; the sampled words
/// are then read from the cache and mixed.
extern "C" fn sample_group(index: u64, _: *mut u8) -> i64 {
    let Some(job) = JOB.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: the map's one value, checked above.
    let job = unsafe { &mut *job };
    // Masked, so that the verifier sees every index within the arrays.
    let first = (index as usize & (BATCH / GROUP - 1)) * GROUP;
    let mut k = 0;
    while k < GROUP {
        let page = job.base.wrapping_add(job.pfns[first + k] << 12);
        // SAFETY: bpf_probe_read_kernel fails cleanly on an address it cannot read; a
        // failure shows again in the read below.
        let _ = unsafe { bpf_probe_read_kernel((page + OFFSETS[0]) as *const u64) };
        k += 1;
    }
    let mut k = 0;
    while k < GROUP {
        let page = job.base.wrapping_add(job.pfns[first + k] << 12);
        job.digests[first + k] = match read_words(page) {
            Some(words) => digest(mix(&words)),
            None => UNREAD,
        };
        k += 1;
    }
    0
}

/// Finds the direct map: the job holds one marker frame (`pfns[0]`) and the mix of its
/// sampled words (`base`); the direct map starts on a 1 GiB boundary at or below any kernel
/// address in it, such as [`HINT`]'s value's, and the first such boundary at which the marker
/// frame reads as expected is its start. Sets `count` to 1 and `base` to the start if found.
#[raw_tracepoint(tracepoint = "rksm_locate")]
pub fn rksm_locate(_ctx: RawTracePointContext) -> i32 {
    let (Some(job), Some(hint)) = (JOB.get_ptr_mut(0), HINT.get_ptr_mut(0)) else {
        return -1;
    };
    // SAFETY: the map's one value. The store keeps the hint's kernel address (allowed to a
    // program loaded with CAP_PERFMON) for the loop to read back as a number.
    unsafe {
        write_volatile(&raw mut (*job).hint, hint as u64);
        (*job).count = 0;
    }
    // SAFETY: as in rksm_sample.
    unsafe { bpf_loop(LOCATE_TRIES, try_base as *mut _, null_mut(), 0) };
    0
}

/// Candidate `k`: 1 (stop) once found or below the lowest place the direct map can be.
extern "C" fn try_base(k: u64, _: *mut u8) -> i64 {
    let Some(job) = JOB.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: the map's one value, checked above.
    let job = unsafe { &mut *job };
    // SAFETY: a field of it; read as the number the locator stored.
    let hint = unsafe { read_volatile(&raw const job.hint) };
    let base = (hint & !(DIRECT_MAP_ALIGN - 1)).wrapping_sub(k.wrapping_mul(DIRECT_MAP_ALIGN));
    if base < DIRECT_MAP_FLOOR {
        return 1;
    }
    match read_words(base.wrapping_add(job.pfns[0] << 12)) {
        Some(words) if mix(&words) == job.base => {
            job.base = base;
            job.count = 1;
            1
        }
        _ => 0,
    }
}

/// The sampled words of the page at kernel address `page`, or None if it cannot be read.
#[inline(always)]
fn read_words(page: u64) -> Option<[u64; WORDS]> {
    let mut words = [0u64; WORDS];
    let mut k = 0;
    const PER: usize = SAMPLE_BYTES / 8;
    while k < OFFSETS.len() {
        // SAFETY: bpf_probe_read_kernel fails cleanly on an address it cannot read.
        let line: [u64; PER] =
            unsafe { bpf_probe_read_kernel((page + OFFSETS[k]) as *const [u64; PER]) }.ok()?;
        let mut j = 0;
        while j < PER {
            words[PER * k + j] = line[j];
            j += 1;
        }
        k += 1;
    }
    Some(words)
}
