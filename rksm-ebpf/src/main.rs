//! rksm's eBPF program: the write-fault tracer.
//!
//! A write to an anonymous page faults only when its PTE is not writable (first touch,
//! copy-on-write, or a page rksm write-protected), so the write faults of a process are an
//! approximation of a dirty bit that the daemon can arm. This program runs on every
//! `exceptions:page_fault_user` event, and on every `exceptions:page_fault_kernel` event at a
//! user address (the kernel writing into the process for it: `read(2)` into a buffer), keeps the write faults of the processes the daemon
//! put in `RKSM_TRACKED`, and pushes one `(tgid, page)` record per fault into a ring the
//! daemon drains. It never drops a write silently: when the ring is full the fault is
//! counted as lost against its process, which the daemon then treats as entirely written.
#![no_std]
#![no_main]
// The bpf target has no atomic types in `core`, but LLVM lowers the intrinsic to BPF_ATOMIC.
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::intrinsics::{atomic_xadd, AtomicOrdering};

mod copier;
mod guard;
mod marks;
mod sampler;
mod waits;

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    macros::{map, tracepoint},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
    EbpfContext,
};
use aya_log_ebpf::warn;
use rksm_common::{
    tracepoint::{ADDRESS_OFFSET, ERROR_CODE_OFFSET, USER_ADDRESS_END, X86_PF_WRITE},
    TracerCounters, TrackedProcess, WriteRecord, DEFAULT_RING_BYTES, MAX_TRACKED, PAGE_MASK,
};

#[map(name = "RKSM_TRACKED")]
static TRACKED: HashMap<u32, TrackedProcess> = HashMap::with_max_entries(MAX_TRACKED, 0);

#[map(name = "RKSM_RECORDS")]
static RECORDS: RingBuf = RingBuf::with_byte_size(DEFAULT_RING_BYTES, 0);

#[map(name = "RKSM_WAKE")]
static WAKE: Array<u64> = Array::with_max_entries(1, 0);

#[map(name = "RKSM_COUNTERS")]
static COUNTERS: PerCpuArray<TracerCounters> = PerCpuArray::with_max_entries(1, 0);

#[tracepoint(category = "exceptions", name = "page_fault_user")]
pub fn rksm_page_fault_user(ctx: TracePointContext) -> u32 {
    record_write_fault(&ctx);
    0
}

/// The kernel writing into user memory for the process (copy_to_user in `read(2)`, `recv(2)`)
/// faults in kernel mode. Faults on the kernel's own addresses are not the process's writes.
#[tracepoint(category = "exceptions", name = "page_fault_kernel")]
pub fn rksm_page_fault_kernel(ctx: TracePointContext) -> u32 {
    // SAFETY: as in record_write_fault: a checked offset, read with bpf_probe_read_kernel.
    match unsafe { ctx.read_at::<u64>(ADDRESS_OFFSET) } {
        Ok(address) if address < USER_ADDRESS_END => record_write_fault(&ctx),
        _ => {}
    }
    0
}

#[inline(always)]
fn record_write_fault(ctx: &TracePointContext) {
    let counters = COUNTERS.get_ptr_mut(0);
    bump(counters, |c| &mut c.events);

    let tgid = ctx.tgid();
    let Some(tracked) = TRACKED.get_ptr_mut(tgid) else {
        return;
    };
    // SAFETY: the offsets are those of the tracepoint's format file, which the daemon checks
    // before it loads this program; bpf_probe_read_kernel fails cleanly on a bad read.
    let error_code: u64 = match unsafe { ctx.read_at(ERROR_CODE_OFFSET) } {
        Ok(v) => v,
        Err(_) => return,
    };
    if error_code & X86_PF_WRITE == 0 {
        return;
    }
    bump(counters, |c| &mut c.tracked_writes);
    // SAFETY: `tracked` points into a preallocated hash-map value that stays valid for the
    // whole program run; other CPUs update it too, hence the atomic add.
    unsafe {
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*tracked).write_faults, 1)
    };

    // SAFETY: as above.
    let address: Option<u64> = unsafe { ctx.read_at(ADDRESS_OFFSET) }.ok();
    let stored = match (address, RECORDS.reserve::<WriteRecord>(0)) {
        (Some(address), Some(mut entry)) => {
            entry.write(WriteRecord {
                tgid,
                _pad: 0,
                page: address & PAGE_MASK,
            });
            entry.submit(wake_flags());
            true
        }
        (None, Some(entry)) => {
            entry.discard(0);
            false
        }
        (_, None) => false,
    };
    if stored {
        bump(counters, |c| &mut c.recorded);
        return;
    }
    bump(counters, |c| &mut c.lost);
    // The add's return value is not used: fetching it needs BPF v3 atomics, and the read
    // below only decides whether to log (a race logs twice or not at all, never loses a count).
    // SAFETY: as above.
    let first_loss = unsafe { (*tracked).lost } == 0;
    // SAFETY: as above.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*tracked).lost, 1) };
    if first_loss {
        warn!(
            ctx,
            target: "rksm::ebpf",
            "write record ring full: tgid {} is now treated as fully written", tgid
        );
    }
}

/// How a record is submitted: wake the daemon by the ring's own rule (threshold 0), or only
/// once the records waiting reach the threshold, so that a daemon with nothing to do between
/// passes sleeps through the writes of its targets.
#[inline(always)]
fn wake_flags() -> u64 {
    match WAKE.get(0).copied().unwrap_or(0) {
        0 => 0,
        threshold if RECORDS.query(BPF_RB_AVAIL_DATA as u64) >= threshold => {
            BPF_RB_FORCE_WAKEUP as u64
        }
        _ => BPF_RB_NO_WAKEUP as u64,
    }
}

/// Adds one to a field of this CPU's counters.
#[inline(always)]
fn bump(
    counters: Option<*mut TracerCounters>,
    field: impl FnOnce(&mut TracerCounters) -> &mut u64,
) {
    if let Some(counters) = counters {
        // SAFETY: a per-CPU array slot is only touched by programs running on this CPU, and a
        // tracepoint program is not preempted by another run of itself on the same CPU.
        *field(unsafe { &mut *counters }) += 1;
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
