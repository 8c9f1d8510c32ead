//! Single-core scan throughput on cold, duplicate-free memory, hash-only mode, and the memory
//! rksm keeps per tracked page.
//!
//! A forked child maps N GiB and writes a different first word into every page (so no two
//! pages are equal and none is zero). One thread, pinned to one CPU, then scans it with the
//! real scanner: pass 1 (nothing known: read + checksum, every page fails the gate) and
//! pass 2 (steady state: read + checksum + gate + unstable-tree insert for every page). The
//! same run measures what bounds it: memcpy bandwidth, raw `process_vm_readv` bandwidth into
//! the scan's 2 MiB buffer, and checksum speed on a page in cache.
//!
//! Run as root: `cargo xtask bench` (or `cargo bench -p rksm --bench scan`).
//! `RKSM_BENCH_SCAN_GIB=1,4,16` picks the sizes; `RKSM_BENCH_REPS=3` the repetitions.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    io::IoSliceMut,
    sync::atomic::{AtomicIsize, Ordering},
    time::{Duration, Instant},
};

use nix::{
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::Pid,
};
use rksm::{
    engine::{
        checksum::ChecksumKind,
        dirty::{HashOnly, Lent},
        scan::{ScanConfig, Scanner},
        target::Target as ScanTarget,
    },
    kernel::{process::Process, remote::Borrower},
};

/// Counts live heap bytes, to measure what the scanner keeps per page.
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

use rksm_common::PAGE;
const GIB: usize = 1 << 30;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbps(bytes: usize, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e9
}

/// A child holding `bytes` of distinct pages; killed on drop.
struct Target {
    pid: i32,
    base: usize,
}

impl Target {
    fn spawn(bytes: usize) -> Target {
        // SAFETY: a fresh private mapping in this process, inherited by the child.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED, "mmap {bytes}");
        let mut fds = [0; 2];
        // SAFETY: pipe writes two fds into the array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only touches its own copy of the mapping, then writes one byte
        // and sleeps; it runs no allocator or lock-taking code.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: raw syscalls on memory and fds this process owns.
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                for i in 0..bytes / PAGE {
                    (base as *mut u64)
                        .add(i * PAGE / 8)
                        .write_volatile(i as u64 + 1);
                }
                libc::write(fds[1], b"r".as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        // SAFETY: the parent never uses its copy: unmap it so only the child holds memory.
        unsafe { libc::munmap(base, bytes) };
        let mut byte = 0u8;
        // SAFETY: reads one byte into a local.
        let got = unsafe { libc::read(fds[0], (&mut byte as *mut u8).cast(), 1) };
        assert_eq!(got, 1, "child did not get ready");
        // SAFETY: closing our pipe ends.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        Target {
            pid,
            base: base as usize,
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // SAFETY: kill and reap our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

fn pin_to_one_cpu() {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only
    // touch it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

fn memcpy_gbps(reps: usize) -> f64 {
    let src = vec![1u8; GIB];
    let mut dst = vec![0u8; GIB];
    let runs = (0..reps.max(3))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            gbps(GIB, t.elapsed())
        })
        .collect();
    std::hint::black_box(&dst);
    median(runs)
}

fn readv_gbps(target: &Target, bytes: usize) -> f64 {
    let mut buf = vec![0u8; 512 * PAGE];
    let t = Instant::now();
    let mut addr = target.base;
    while addr < target.base + bytes {
        let remote = [RemoteIoVec {
            base: addr,
            len: buf.len(),
        }];
        process_vm_readv(
            Pid::from_raw(target.pid),
            &mut [IoSliceMut::new(&mut buf)],
            &remote,
        )
        .expect("process_vm_readv");
        addr += buf.len();
    }
    gbps(bytes, t.elapsed())
}

fn checksum_in_cache_gbps(kind: ChecksumKind) -> f64 {
    let page: Vec<u8> = (0..PAGE).map(|i| i as u8).collect();
    let n = 200_000;
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(kind.checksum(std::hint::black_box(&page)));
    }
    gbps(n * PAGE, t.elapsed())
}

fn main() {
    // `cargo bench` passes --bench; nothing else is expected.
    // SAFETY: geteuid has no arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the scan benchmark reads another process's PFNs and kpageflags: run it as root (cargo xtask bench)");
        std::process::exit(1);
    }
    let sizes: Vec<usize> = std::env::var("RKSM_BENCH_SCAN_GIB")
        .unwrap_or_else(|_| "1,4,16".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let reps: usize = std::env::var("RKSM_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    pin_to_one_cpu();

    println!("# scan throughput, one core, hash-only, duplicate-free memory (medians of {reps})");
    println!("memcpy (1 GiB, in-process): {:.2} GB/s", memcpy_gbps(reps));
    for kind in [ChecksumKind::Xxh64, ChecksumKind::Crc32c] {
        println!(
            "{kind} on a cached page: {:.2} GB/s",
            checksum_in_cache_gbps(kind)
        );
    }
    println!();
    println!("| target | process_vm_readv only | checksum | pass 1 (cold) | pass 2 (steady) | heap per tracked page |");
    println!("|---|---|---|---|---|---|");
    for gib in sizes {
        let bytes = gib * GIB;
        let target = Target::spawn(bytes);
        let readv = median((0..reps).map(|_| readv_gbps(&target, bytes)).collect());
        for kind in [ChecksumKind::Xxh64, ChecksumKind::Crc32c] {
            let (mut cold, mut steady, mut per_page) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..reps {
                let mut process = vec![ScanTarget::new(
                    Process::open(target.pid as u32).expect("target"),
                )];
                let before = LIVE.load(Ordering::Relaxed);
                let mut scanner = Scanner::new(
                    ScanConfig {
                        checksum: kind,
                        ..ScanConfig::default()
                    },
                    Box::new(HashOnly),
                )
                .expect("scanner");
                let first = scanner.pass(
                    &mut process,
                    &mut Lent::borrower(&Borrower::new()),
                    &mut |_| {},
                );
                let second = scanner.pass(
                    &mut process,
                    &mut Lent::borrower(&Borrower::new()),
                    &mut |_| {},
                );
                assert!(
                    second.total.unique_pages >= (bytes / PAGE) as u64,
                    "pages missing: {:?}",
                    second.total
                );
                cold.push(gbps(bytes, Duration::from_secs_f64(first.seconds)));
                steady.push(gbps(bytes, Duration::from_secs_f64(second.seconds)));
                per_page.push(
                    (LIVE.load(Ordering::Relaxed) - before) as f64
                        / second.total.scanned_pages as f64,
                );
            }
            println!(
                "| {gib} GiB | {readv:.2} GB/s | {kind} | {:.2} GB/s | {:.2} GB/s | {:.1} B |",
                median(cold),
                median(steady),
                median(per_page)
            );
        }
    }
}
