//! Checksum cost per 4 KiB page: xxh64 and crc32c (what rksm offers) and jhash2 (what KSM
//! used before Linux 4.20), on the same page contents, in one run; and a pass's batch of 512
//! pages checksummed together (xxh64 side by side where the CPU can) against one by one.
//!
//! Run: `cargo bench -p rksm --bench checksum`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rksm::engine::checksum::{jhash2, ChecksumKind};
use rksm_common::PAGE;

fn page() -> Vec<u8> {
    // Not constant, so no checksum can take a shortcut on it.
    (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn checksums(c: &mut Criterion) {
    let page = page();
    let words: Vec<u32> = page
        .chunks_exact(4)
        .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
        .collect();
    let mut group = c.benchmark_group("checksum_4k_page");
    group.throughput(Throughput::Bytes(4096));
    for kind in [ChecksumKind::Xxh64, ChecksumKind::Crc32c] {
        group.bench_with_input(BenchmarkId::from_parameter(kind), &page, |b, page| {
            b.iter(|| kind.checksum(std::hint::black_box(page)))
        });
    }
    group.bench_with_input(BenchmarkId::from_parameter("jhash2"), &words, |b, words| {
        b.iter(|| jhash2(std::hint::black_box(words), 17))
    });
    group.finish();

    // A batch as a pass reads it: 512 pages (2 MiB, within the cache), checksummed together.
    let batch: Vec<[u8; PAGE]> = (0..512u32)
        .map(|k| {
            let mut p = [0u8; PAGE];
            for (i, b) in p.iter_mut().enumerate() {
                *b = ((i as u32 ^ k).wrapping_mul(2_654_435_761) >> 13) as u8;
            }
            p
        })
        .collect();
    let pages: Vec<&[u8; PAGE]> = batch.iter().collect();
    let mut sums = vec![0u64; pages.len()];
    let mut group = c.benchmark_group("checksum_512_pages");
    group.throughput(Throughput::Bytes((512 * PAGE) as u64));
    for kind in [ChecksumKind::Xxh64, ChecksumKind::Crc32c] {
        group.bench_function(BenchmarkId::new("together", kind), |b| {
            b.iter(|| kind.checksum_pages(std::hint::black_box(&pages), &mut sums))
        });
        group.bench_function(BenchmarkId::new("one_by_one", kind), |b| {
            b.iter(|| {
                for (page, sum) in pages.iter().zip(sums.iter_mut()) {
                    *sum = kind.checksum(std::hint::black_box(*page));
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, checksums);
criterion_main!(benches);
