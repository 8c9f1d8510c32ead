//! What reading another process's page costs, whole or as a small sample: the question
//! behind a first pass that reads in full only the pages whose sample matches another's.
//!
//! A forked child owns 1 GiB of pages, each different (it wrote every one after the fork,
//! so none is shared with this process), more than the caches hold: a first pass finds its
//! targets' memory out of the cache, and a page's first bytes cost a trip to memory (and, in
//! a virtual machine, a walk of the host's page tables) whatever is read of it. The batches
//! go round the child's memory in order. Batches of 1,024 of its pages are read with
//! `process_vm_readv` as the scanner reads them: whole (one 4 MiB remote range), whole and
//! checksummed with xxh64, a 64-byte sample of each page (one remote iovec per page), and
//! four 16-byte samples of each page (four iovecs per page, 1,024 per call), and the way
//! rksm samples: the batch's frame numbers read from pagemap and its digests taken by the
//! eBPF sampler through the kernel's direct map (needs root and the eBPF object; skipped
//! without), and the sampler alone with the frames already known. Two more rows say what a
//! read of whole pages is made of: the same amount of this process's own memory (1 GiB,
//! out of the cache too) copied with memcpy, and whole pages copied through the direct map
//! by the eBPF copier, which takes no lock and pins nothing (`rksm::ebpf::copier`), with and
//! without xxh64. Criterion reports each batch; divide by 1,024 for a page.
//!
//! Run: `cargo bench -p rksm --bench sample` (also part of `cargo xtask bench`).

use std::io::IoSliceMut;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nix::{
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::{fork, pipe, read, write, ForkResult, Pid},
};
use rksm::engine::checksum::ChecksumKind;

use rksm_common::PAGE;
const PAGES: usize = 256 * 1024;
const BATCH: usize = 1024;
/// The kernel's limit on iovecs per call.
const IOV_MAX: usize = 1024;

/// A child that owns `PAGES` distinct pages at `base`, until killed.
struct Child {
    pid: Pid,
    base: usize,
}

impl Child {
    fn spawn() -> Child {
        let mut memory = vec![0u8; PAGES * PAGE];
        let base = memory.as_mut_ptr() as usize;
        let (ready_r, ready_w) = pipe().unwrap();
        // SAFETY: the child only writes its own memory, writes to a pipe and sleeps: all
        // async-signal-safe, no allocation.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                for (i, page) in memory.chunks_exact_mut(PAGE).enumerate() {
                    for (j, word) in page.chunks_exact_mut(8).enumerate() {
                        word.copy_from_slice(&((i * 512 + j) as u64 * 0x9E37_79B9).to_ne_bytes());
                    }
                }
                let _ = write(&ready_w, b"r");
                loop {
                    // SAFETY: pause has no arguments; the parent kills this process.
                    unsafe { libc::pause() };
                }
            }
            ForkResult::Parent { child } => {
                drop(ready_w);
                let mut byte = [0u8; 1];
                use std::os::fd::AsRawFd;
                assert_eq!(
                    read(ready_r.as_raw_fd(), &mut byte).unwrap(),
                    1,
                    "the child is ready"
                );
                std::mem::forget(memory);
                Child { pid: child, base }
            }
        }
    }

    /// Page `i` of batch `batch`'s address.
    fn page(&self, batch: usize, i: usize) -> usize {
        self.base + ((batch * BATCH + i) % PAGES) * PAGE
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(self.pid, None);
    }
}

fn reads(c: &mut Criterion) {
    let child = Child::spawn();
    let mut whole = vec![0u8; BATCH * PAGE];
    let mut samples = vec![0u8; BATCH * 64];
    let mut group = c.benchmark_group("read_1024_pages");
    group.throughput(Throughput::Elements(BATCH as u64));
    let mut batch = 0;
    let mut next = || {
        batch = (batch + 1) % (PAGES / BATCH);
        batch
    };
    group.bench_function("whole", |b| {
        b.iter(|| {
            let remote = [RemoteIoVec {
                base: child.page(next(), 0),
                len: BATCH * PAGE,
            }];
            let n = process_vm_readv(child.pid, &mut [IoSliceMut::new(&mut whole)], &remote);
            assert_eq!(n.unwrap(), BATCH * PAGE);
        })
    });
    // The same bytes copied within one process, out of the cache: what reading memory costs
    // here before any system call.
    let own: Vec<u8> = (0..PAGES * PAGE / 8)
        .flat_map(|i| (i as u64 * 0x9E37_79B9).to_ne_bytes())
        .collect();
    group.bench_function("memcpy_own", |b| {
        b.iter(|| {
            let at = next() * BATCH * PAGE;
            whole.copy_from_slice(&own[at..at + BATCH * PAGE]);
            whole[PAGE]
        })
    });
    drop(own);
    group.bench_function("whole_xxh64", |b| {
        b.iter(|| {
            let remote = [RemoteIoVec {
                base: child.page(next(), 0),
                len: BATCH * PAGE,
            }];
            let n = process_vm_readv(child.pid, &mut [IoSliceMut::new(&mut whole)], &remote);
            assert_eq!(n.unwrap(), BATCH * PAGE);
            whole
                .chunks_exact(PAGE)
                .map(|p| ChecksumKind::Xxh64.checksum(p))
                .fold(0, u64::wrapping_add)
        })
    });
    for (name, pieces) in [("sample_64b", 1usize), ("sample_4x16b", 4)] {
        let len = 64 / pieces;
        group.bench_function(name, |b| {
            b.iter(|| {
                let batch = next();
                let child = &child;
                let remote: Vec<RemoteIoVec> = (0..BATCH)
                    .flat_map(|i| {
                        let page = child.page(batch, i);
                        (0..pieces).map(move |k| RemoteIoVec {
                            base: page + k * PAGE / pieces + 8,
                            len,
                        })
                    })
                    .collect();
                let mut read = 0;
                for (chunk, out) in remote
                    .chunks(IOV_MAX)
                    .zip(samples.chunks_mut(IOV_MAX * len))
                {
                    read +=
                        process_vm_readv(child.pid, &mut [IoSliceMut::new(out)], chunk).unwrap();
                }
                assert_eq!(read, BATCH * 64);
            })
        });
    }
    match rksm::ebpf::sampler::Sampler::load(&mut rksm::ebpf::Object::new()) {
        Ok(mut sampler) => {
            let pagemap = rksm::kernel::procfs::Pagemap::open(child.pid.as_raw() as u32).unwrap();
            let mut entries = vec![rksm::kernel::procfs::PagemapEntry(0); BATCH];
            let mut pfns = vec![0u64; BATCH];
            let mut digests = vec![0u32; BATCH];
            group.bench_function("sampler_ebpf", |b| {
                b.iter(|| {
                    let got = pagemap
                        .read(child.page(next(), 0) as u64, &mut entries)
                        .unwrap();
                    assert_eq!(got, BATCH);
                    for (pfn, entry) in pfns.iter_mut().zip(&entries) {
                        *pfn = entry.pfn().expect("present");
                    }
                    sampler.sample(&pfns, &mut digests).unwrap();
                    assert!(digests.iter().all(|&d| d != 0));
                })
            });
        }
        Err(e) => eprintln!("sampler_ebpf skipped: {e}"),
    }
    // The sampler alone, the frames known: what the trips to memory cost without pagemap.
    if let Ok(mut sampler) = rksm::ebpf::sampler::Sampler::load(&mut rksm::ebpf::Object::new()) {
        let pagemap = rksm::kernel::procfs::Pagemap::open(child.pid.as_raw() as u32).unwrap();
        let mut entries = vec![rksm::kernel::procfs::PagemapEntry(0); BATCH];
        let mut pfns = Vec::with_capacity(PAGES);
        for k in 0..PAGES / BATCH {
            pagemap.read(child.page(k, 0) as u64, &mut entries).unwrap();
            pfns.extend(entries.iter().map(|e| e.pfn().expect("present")));
        }
        let mut digests = vec![0u32; BATCH];
        group.bench_function("sampler_ebpf_frames_known", |b| {
            b.iter(|| {
                let k = next();
                sampler
                    .sample(&pfns[k * BATCH..(k + 1) * BATCH], &mut digests)
                    .unwrap();
                assert!(digests.iter().all(|&d| d != 0));
            })
        });
    }
    // Whole pages through the direct map, the frames read from pagemap each batch.
    let mut object = rksm::ebpf::Object::new();
    if let Ok(sampler) = rksm::ebpf::sampler::Sampler::load(&mut object) {
        match rksm::ebpf::copier::Copier::load(&mut object, sampler.direct_map()) {
            Ok(mut copier) => {
                let pagemap =
                    rksm::kernel::procfs::Pagemap::open(child.pid.as_raw() as u32).unwrap();
                let mut entries = vec![rksm::kernel::procfs::PagemapEntry(0); BATCH];
                let mut pfns = vec![0u64; BATCH];
                let mut copied = vec![false; BATCH];
                group.bench_function("whole_ebpf_copy", |b| {
                    b.iter(|| {
                        let at = child.page(next(), 0) as u64;
                        frames(&pagemap, at, &mut entries, &mut pfns);
                        copier.copy(&pfns, 0, &mut copied).unwrap();
                        assert!(copied.iter().all(|&c| c));
                    })
                });
                group.bench_function("whole_ebpf_copy_xxh64", |b| {
                    b.iter(|| {
                        let at = child.page(next(), 0) as u64;
                        frames(&pagemap, at, &mut entries, &mut pfns);
                        copier.copy(&pfns, 0, &mut copied).unwrap();
                        copier.slots()[..BATCH * PAGE]
                            .chunks_exact(PAGE)
                            .map(|p| ChecksumKind::Xxh64.checksum(p))
                            .fold(0, u64::wrapping_add)
                    })
                });
            }
            Err(e) => eprintln!("whole_ebpf_copy skipped: {e}"),
        }
    }
    group.finish();
}

/// The frames of the pages from `at` on, as many as `pfns` holds, from `pagemap`.
fn frames(
    pagemap: &rksm::kernel::procfs::Pagemap,
    at: u64,
    entries: &mut [rksm::kernel::procfs::PagemapEntry],
    pfns: &mut [u64],
) {
    assert_eq!(pagemap.read(at, entries).unwrap(), pfns.len());
    for (pfn, entry) in pfns.iter_mut().zip(entries.iter()) {
        *pfn = entry.pfn().expect("present");
    }
}

criterion_group!(benches, reads);
criterion_main!(benches);
