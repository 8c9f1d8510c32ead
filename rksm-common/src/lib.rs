//! Types and constants shared by rksm's eBPF program (`rksm-ebpf`) and its daemon.
//!
//! Both sides must agree byte for byte on the layout of every map key and value and on where
//! the program reads the tracepoint's fields, so those definitions live here, once, as
//! `#[repr(C)]` types. The crate is `no_std` so the eBPF side can use it; the daemon enables
//! the `user` feature to read the types out of aya maps.
#![no_std]

/// Page size the tracer rounds fault addresses down to (x86_64 base pages).
pub const PAGE_SIZE: u64 = 4096;
/// The page size as a length, for buffers of pages.
pub const PAGE: usize = PAGE_SIZE as usize;
/// Mask that keeps the page part of a virtual address.
pub const PAGE_MASK: u64 = !(PAGE_SIZE - 1);

/// Where the program reads the fields of `exceptions:page_fault_user` and
/// `exceptions:page_fault_kernel` (one event class, one layout).
///
/// The daemon checks these against the tracepoint's format file before it loads the program
/// and refuses to run if they differ: reading at a wrong offset would silently turn every
/// fault into garbage.
pub mod tracepoint {
    /// Tracefs category of the tracepoint.
    pub const CATEGORY: &str = "exceptions";
    /// Tracefs name of the tracepoint of faults taken in user mode.
    pub const NAME: &str = "page_fault_user";
    /// Tracefs name of the tracepoint of faults taken in kernel mode: the kernel writing into
    /// a process's memory on its behalf (`read(2)` into a buffer, `recv(2)`).
    pub const KERNEL_NAME: &str = "page_fault_kernel";
    /// `unsigned long address`: the faulting virtual address.
    pub const ADDRESS_OFFSET: usize = 8;
    /// `unsigned long ip`: the user instruction pointer (not used, checked for layout).
    pub const IP_OFFSET: usize = 16;
    /// `unsigned long error_code`: the x86 page-fault error code.
    pub const ERROR_CODE_OFFSET: usize = 24;
    /// Size of each of the three fields above.
    pub const FIELD_SIZE: usize = 8;
    /// x86 page-fault error code bit: the access was a write.
    pub const X86_PF_WRITE: u64 = 1 << 1;
    /// User addresses are the lower canonical half on x86_64 (4- and 5-level paging alike):
    /// a kernel-mode fault at or above this is the kernel's own memory.
    pub const USER_ADDRESS_END: u64 = 1 << 63;
}

/// Names of the program and its maps, as the eBPF object spells them.
pub mod names {
    /// The program on user-mode faults.
    pub const PROGRAM: &str = "rksm_page_fault_user";
    /// The program on kernel-mode faults at user addresses.
    pub const KERNEL_PROGRAM: &str = "rksm_page_fault_kernel";
    /// `HashMap<u32 tgid, TrackedProcess>`: which processes are traced, and their counters.
    pub const TRACKED: &str = "RKSM_TRACKED";
    /// `RingBuf` of [`WriteRecord`](crate::WriteRecord)s.
    pub const RECORDS: &str = "RKSM_RECORDS";
    /// `PerCpuArray<TracerCounters>` with a single slot.
    pub const COUNTERS: &str = "RKSM_COUNTERS";
    /// `Array<u64>` with a single slot: when the program wakes the daemon. 0: for the first
    /// record after the daemon caught up (the ring's own rule, for a daemon that must see
    /// writes at once); else once this many bytes of records wait unread.
    pub const WAKE: &str = "RKSM_WAKE";
}

/// The userfaultfd guard: what lets a target take up userfaultfd itself although rksm holds
/// one registered over its memory (a second registration of a VMA fails with `EBUSY`).
///
/// Two programs watch the targets rksm holds a userfaultfd for (`HELD`): creating a
/// userfaultfd or `UFFDIO_API` on one posts a claim (the pid) to a ring the daemon waits on,
/// and `UFFDIO_REGISTER` also holds the calling thread at the call's entry, until the daemon
/// has given its userfaultfd up (it deletes the pid from `HELD`) or [`MAX_HOLD_NS`] passed.
pub mod uffd_guard {
    /// Tracefs category of the system-call tracepoints.
    pub const CATEGORY: &str = "syscalls";
    /// The tracepoint at the entry of `userfaultfd(2)`.
    pub const CREATE_EVENT: &str = "sys_enter_userfaultfd";
    /// The tracepoint at the entry of `ioctl(2)`.
    pub const IOCTL_EVENT: &str = "sys_enter_ioctl";
    /// Where `sys_enter_ioctl` has `cmd` (`unsigned int`, stored in 8 bytes).
    pub const IOCTL_CMD_OFFSET: usize = 24;
    /// `USERFAULTFD_IOC_NEW`: a userfaultfd from /dev/userfaultfd.
    pub const USERFAULTFD_IOC_NEW: u32 = 0xAA00;
    /// `UFFDIO_API`, the first call on any new userfaultfd.
    pub const UFFDIO_API: u32 = 0xC018_AA3F;
    /// `UFFDIO_REGISTER`, the call rksm's registration would make fail.
    pub const UFFDIO_REGISTER: u32 = 0xC020_AA00;
    /// The longest a `UFFDIO_REGISTER` is held for the daemon to give its userfaultfd up.
    pub const MAX_HOLD_NS: u64 = 100_000_000;
    /// Program names.
    pub const CREATE_PROGRAM: &str = "rksm_uffd_create";
    /// Program names.
    pub const IOCTL_PROGRAM: &str = "rksm_uffd_ioctl";
    /// `HashMap<u32 tgid, u32>`: the targets rksm holds a userfaultfd for.
    pub const HELD: &str = "RKSM_UFFD_HELD";
    /// `RingBuf` of `u32` pids that take up userfaultfd.
    pub const CLAIMS: &str = "RKSM_UFFD_CLAIMS";
    /// Size of the claim ring.
    pub const CLAIM_RING_BYTES: u32 = 16 << 10;
}

/// The mark watch: every process that asks the kernel to make memory mergeable
/// (`madvise(MADV_MERGEABLE)`, `prctl(PR_SET_MEMORY_MERGE, 1)`) is recorded in `MARKERS`
/// (tgid → CLOCK_MONOTONIC nanoseconds of its latest such call), so that one marking its
/// memory between two of the daemon's looks at /proc is seen all the same.
pub mod marks {
    /// Program names and their tracepoints.
    pub const PROGRAMS: [(&str, &str); 2] = [
        ("rksm_mark_madvise", "sys_enter_madvise"),
        ("rksm_mark_prctl", "sys_enter_prctl"),
    ];
    /// Where `sys_enter_madvise` has `behavior` (an `int` stored in 8 bytes).
    pub const MADVISE_BEHAVIOR_OFFSET: usize = 32;
    /// Where `sys_enter_prctl` has `option` and `arg2`.
    pub const PRCTL_OPTION_OFFSET: usize = 16;
    /// See [`PRCTL_OPTION_OFFSET`].
    pub const PRCTL_ARG2_OFFSET: usize = 24;
    /// `MADV_MERGEABLE`.
    pub const MADV_MERGEABLE: u64 = 12;
    /// `PR_SET_MEMORY_MERGE` (Linux 6.4).
    pub const PR_SET_MEMORY_MERGE: u64 = 67;
    /// `LruHashMap<u32 tgid, u64 ns>`.
    pub const MARKERS: &str = "RKSM_MARKERS";
    /// Processes remembered between two looks (the least recent are forgotten first).
    pub const MAX_MARKERS: u32 = 16384;
}

/// The wait watch: when the threads of rksm's targets entered their latest `epoll_wait` or
/// `epoll_pwait` (CLOCK_MONOTONIC nanoseconds), for those of the processes in `WAITERS`
/// (pid → CLOCK_MONOTONIC nanoseconds when it was added, older entries being another
/// process's).
pub mod waits {
    /// Program names and their tracepoints.
    pub const PROGRAMS: [(&str, &str); 2] = [
        ("rksm_epoll_wait", "sys_enter_epoll_wait"),
        ("rksm_epoll_pwait", "sys_enter_epoll_pwait"),
    ];
    /// `HashMap<u32 pid, u64 added_ns>`.
    pub const WAITERS: &str = "RKSM_WAITERS";
    /// `LruHashMap<u32 tid, u64 entered_ns>`.
    pub const ENTERED: &str = "RKSM_WAIT_ENTERED";
    /// Threads remembered at once (the least recently entered are forgotten first).
    pub const MAX_WAITING_THREADS: u32 = 65536;
}

/// The sampler: a program run on demand (`BPF_PROG_TEST_RUN`) that reads a few bytes of each
/// of a batch of physical pages through the kernel's direct map and returns a digest of them,
/// so that a page nothing else resembles is never copied out of its process.
pub mod sample {
    /// Program names: the sampler, and the one that finds the direct map (run once).
    pub const SAMPLE_PROGRAM: &str = "rksm_sample";
    /// See [`SAMPLE_PROGRAM`].
    pub const LOCATE_PROGRAM: &str = "rksm_locate";
    /// `Array<SampleJob>` of one entry, mapped into the daemon (`BPF_F_MMAPABLE`): the batch
    /// in, the digests out, with no copy of the job through a system call.
    pub const JOB: &str = "RKSM_SAMPLE_JOB";
    /// `Array<u64>` of one entry, in the direct map, where the locator starts from.
    pub const HINT: &str = "RKSM_SAMPLE_HINT";
    /// Pages per run of the sampler.
    pub const BATCH: usize = 512;
    /// The sampler takes pages this many at a time: a job's `count` is a multiple of it
    /// (the daemon repeats a batch's last frame to make it one), and `BATCH` too.
    pub const GROUP: usize = 8;
    /// Where the sampled bytes are in a page: [`SAMPLE_BYTES`] at each, the cache line at the
    /// middle of the page. A line not in the cache costs a trip to memory whatever is read
    /// of it, and the sample is what touches every new page: one line a page is half the
    /// trips of two. Pages that share a header differ in it, pages
    /// of zeros with a few values near their start do not: pages that differ only outside
    /// it look alike to the sample and are read whole. It decides what is compared, never
    /// what is equal.
    pub const OFFSETS: [u64; 1] = [2048];
    /// Bytes read at each offset: the whole cache line.
    pub const SAMPLE_BYTES: usize = 64;
    /// The sampled words of a page, in order.
    pub const WORDS: usize = OFFSETS.len() * SAMPLE_BYTES / 8;
    /// Where the direct map may begin, at the lowest (Linux's `__PAGE_OFFSET_BASE_L5`).
    pub const DIRECT_MAP_FLOOR: u64 = 0xff11_0000_0000_0000;
    /// The direct map begins on a 1 GiB boundary (with or without KASLR).
    pub const DIRECT_MAP_ALIGN: u64 = 1 << 30;
    /// Candidates for the direct map's start that the locator tries, at most.
    pub const LOCATE_TRIES: u32 = 1 << 16;
    /// A digest the sampler gives a page it could not read.
    pub const UNREAD: u32 = 0;

    /// One run of the sampler.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct SampleJob {
        /// Kernel virtual address of physical address 0 in the direct map. The locator
        /// writes it; before, it holds the full mix of the marker page's sampled words.
        pub base: u64,
        /// The locator's scratch: a kernel address in the direct map.
        pub hint: u64,
        /// Pages in this batch: a multiple of [`GROUP`].
        pub count: u32,
        /// Reserved, zero.
        pub _pad: u32,
        /// Page frame numbers.
        pub pfns: [u64; BATCH],
        /// Their digests ([`UNREAD`] where a page could not be read).
        pub digests: [u32; BATCH],
    }

    /// Mixes the sampled words of a page (both sides compute it the same way).
    #[inline(always)]
    pub fn mix(words: &[u64; WORDS]) -> u64 {
        let mut h: u64 = 0x2545_f491_4f6c_dd1d;
        let mut i = 0;
        while i < WORDS {
            h = (h ^ words[i]).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            h ^= h >> 29;
            i += 1;
        }
        h
    }

    /// The digest of a page whose words mix to `mixed`: never [`UNREAD`].
    #[inline(always)]
    pub fn digest(mixed: u64) -> u32 {
        match (mixed >> 32) as u32 {
            UNREAD => 1,
            d => d,
        }
    }

    /// The digest the sampler gives a page with these bytes (4096 of them).
    pub fn digest_of(page: &[u8]) -> u32 {
        digest(mix(&words_of(page)))
    }

    /// The sampled words of `page` (4096 bytes).
    pub fn words_of(page: &[u8]) -> [u64; WORDS] {
        let mut words = [0u64; WORDS];
        let mut i = 0;
        while i < WORDS {
            let per = SAMPLE_BYTES / 8;
            let at = OFFSETS[i / per] as usize + (i % per) * 8;
            let mut b = [0u8; 8];
            b.copy_from_slice(&page[at..at + 8]);
            words[i] = u64::from_ne_bytes(b);
            i += 1;
        }
        words
    }
}

/// The copier: whole pages read through the kernel's direct map into a map mapped into
/// user space, measured against `process_vm_readv` (see the daemon's `ebpf::copier`).
pub mod copy {
    /// The program.
    pub const COPY_PROGRAM: &str = "rksm_copy";
    /// `Array<CopyJob>` of one entry, mapped into the daemon (`BPF_F_MMAPABLE`).
    pub const JOB: &str = "RKSM_COPY_JOB";
    /// `Array<[u8; PAGE]>` of [`SLOTS`] entries, mapped into the daemon: where pages land.
    pub const PAGES: &str = "RKSM_COPY_PAGES";
    /// Pages per run of the copier.
    pub const BATCH: usize = 128;
    /// Slots the pages land in.
    pub const SLOTS: u32 = 1024;

    /// One run of the copier: frame `pfns[i]` into slot `first + i`, for `i < count`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct CopyJob {
        /// Kernel virtual address of physical address 0 in the direct map.
        pub base: u64,
        /// Pages in this batch, at most [`BATCH`].
        pub count: u32,
        /// The slot of the first page; `first + count` is at most [`SLOTS`].
        pub first: u32,
        /// Page frame numbers.
        pub pfns: [u64; BATCH],
        /// 1 where a page was copied, 0 where its frame could not be read.
        pub copied: [u8; BATCH],
    }
}

/// Default capacity of the tracked-process map.
pub const MAX_TRACKED: u32 = 16384;
/// Default size of the record ring in bytes (a power of two, a multiple of the page size).
/// Each record takes 24 bytes in the ring (8 bytes of header), so this holds ~175k faults
/// between two drains. Every page of it is resident in the daemon from the start (the kernel
/// fills a ring's pages when they are mapped), so it is sized by the drain's pace: see the
/// daemon's wait.
pub const DEFAULT_RING_BYTES: u32 = 4 << 20;

/// One write fault of a tracked process, as the program pushes it into the ring.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteRecord {
    /// Process (thread-group) id of the faulting task.
    pub tgid: u32,
    /// Reserved, zero; keeps `page` 8-byte aligned without implicit padding.
    pub _pad: u32,
    /// Faulting virtual address rounded down to its page.
    pub page: u64,
}

/// Value of the tracked-process map: the per-process counters the program maintains.
///
/// The program only updates existing entries (with atomic adds), never inserts: the daemon
/// decides which processes are tracked, and a full map can never cost a record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackedProcess {
    /// Write faults seen for this process since it was tracked.
    pub write_faults: u64,
    /// Write faults that could not be stored in the ring. Any increase means the daemon must
    /// treat the whole process as written.
    pub lost: u64,
}

/// Per-CPU counters of the program, summed by the daemon.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TracerCounters {
    /// Every `page_fault_user` event the program ran for.
    pub events: u64,
    /// Write faults of tracked processes.
    pub tracked_writes: u64,
    /// Write faults stored in the ring.
    pub recorded: u64,
    /// Write faults that could not be stored (ring full).
    pub lost: u64,
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all three are #[repr(C)], made only of u32/u64 fields with explicit padding, so
    // every bit pattern is a valid value and there are no uninitialised bytes.
    unsafe impl aya::Pod for super::WriteRecord {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::TrackedProcess {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::TracerCounters {}
}
