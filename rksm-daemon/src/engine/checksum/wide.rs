//! xxh64 of many pages at once, for the batches a pass reads.
//!
//! xxh64 keeps four 64-bit accumulators and multiplies each twice per 32 bytes, so one page
//! at a time runs at the speed of the CPU's one 64-bit multiplier. The four accumulators are
//! the four lanes of a 256-bit register, and AVX-512's `vpmullq` multiplies them at once;
//! its latency is long, so a group of pages is hashed side by side, each page in its own
//! register, which keeps the vector multiplier busy. The result is xxh64's own, bit for bit
//! (a test checks it against the reference implementation): only the order in which the
//! CPU does the work changes. 256-bit registers rather than 512, although two pages to a
//! 512-bit register hash a batch somewhat faster where the CPU has them: 512-bit multiplies
//! lower the clock of their core on some Intel CPUs (Skylake-SP), which would slow whatever
//! else runs on that core, and rksm shares the host with the processes it serves.

use rksm_common::PAGE;

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;

/// Pages hashed side by side in the main group, and in the group used for what is left.
const GROUP: usize = 16;
const SMALL_GROUP: usize = 8;

/// Whether this CPU has what [`xxh64_pages`] needs (checked once; std caches it).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The xxh64 (seed 0) of each of `pages`, into `sums` (one per page), as
/// `xxhash_rust::xxh64::xxh64(page, 0)` would give them. Needs [`available`].
pub fn xxh64_pages(pages: &[&[u8; PAGE]], sums: &mut [u64]) {
    assert!(available(), "xxh64_pages needs AVX-512 (F, DQ, VL)");
    assert_eq!(pages.len(), sums.len());
    let mut done = 0;
    while pages.len() - done >= GROUP {
        // SAFETY: the CPU has the features the function enables (asserted above).
        unsafe { group::<GROUP>(&pages[done..done + GROUP], &mut sums[done..done + GROUP]) };
        done += GROUP;
    }
    while pages.len() - done >= SMALL_GROUP {
        let to = done + SMALL_GROUP;
        // SAFETY: as above.
        unsafe { group::<SMALL_GROUP>(&pages[done..to], &mut sums[done..to]) };
        done = to;
    }
    // Fewer pages than a small group: one at a time is as fast.
    for (page, sum) in pages[done..].iter().zip(&mut sums[done..]) {
        *sum = xxhash_rust::xxh64::xxh64(*page, 0);
    }
}

/// `N` pages, each in its own register.
///
/// # Safety
/// The CPU must have AVX-512 F, DQ and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl")]
unsafe fn group<const N: usize>(pages: &[&[u8; PAGE]], sums: &mut [u64]) {
    use std::arch::x86_64::*;
    let prime1 = _mm256_set1_epi64x(P1 as i64);
    let prime2 = _mm256_set1_epi64x(P2 as i64);
    // Lane k is the accumulator that takes bytes 8k..8k+8 of every 32.
    let start = _mm256_set_epi64x(
        0u64.wrapping_sub(P1) as i64,
        0,
        P2 as i64,
        P1.wrapping_add(P2) as i64,
    );
    let mut acc = [start; N];
    for stripe in 0..PAGE / 32 {
        for (acc, page) in acc.iter_mut().zip(pages) {
            // SAFETY: `stripe * 32 + 32 <= PAGE`, within the page; an unaligned load.
            let input =
                unsafe { _mm256_loadu_si256(page.as_ptr().add(stripe * 32).cast::<__m256i>()) };
            let sum = _mm256_add_epi64(*acc, _mm256_mullo_epi64(input, prime2));
            *acc = _mm256_mullo_epi64(_mm256_rol_epi64::<31>(sum), prime1);
        }
    }
    for (acc, sum) in acc.iter().zip(sums) {
        let mut lanes = [0u64; 4];
        // SAFETY: `lanes` is 32 bytes, what an unaligned 256-bit store writes.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), *acc) };
        *sum = finish(lanes);
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn group<const N: usize>(_: &[&[u8; PAGE]], _: &mut [u64]) {
    unreachable!("available() is false")
}

/// xxh64's end for a page: the accumulators merged, the length added, the bits avalanched.
fn finish([v1, v2, v3, v4]: [u64; 4]) -> u64 {
    let mut h = v1
        .rotate_left(1)
        .wrapping_add(v2.rotate_left(7))
        .wrapping_add(v3.rotate_left(12))
        .wrapping_add(v4.rotate_left(18));
    for v in [v1, v2, v3, v4] {
        let v = v.wrapping_mul(P2).rotate_left(31).wrapping_mul(P1);
        h = (h ^ v).wrapping_mul(P1).wrapping_add(P4);
    }
    h = h.wrapping_add(PAGE as u64);
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of varied contents: a deterministic generator, zeros, one byte set.
    fn pages(n: usize, seed: u64) -> Vec<[u8; PAGE]> {
        let mut x = seed | 1;
        (0..n)
            .map(|i| {
                let mut page = [0u8; PAGE];
                match i % 5 {
                    0 => {}
                    1 => page[i % PAGE] = 1,
                    _ => {
                        for word in page.chunks_exact_mut(8) {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            word.copy_from_slice(&x.to_le_bytes());
                        }
                    }
                }
                page
            })
            .collect()
    }

    #[test]
    fn gives_xxh64_itself_for_every_group_size() {
        if !available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        // Every way a batch splits: full groups, a small group, single pages, and none.
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 33, 512] {
            let pages = pages(n, n as u64 + 3);
            let refs: Vec<&[u8; PAGE]> = pages.iter().collect();
            let mut sums = vec![0; n];
            xxh64_pages(&refs, &mut sums);
            for (i, page) in pages.iter().enumerate() {
                assert_eq!(
                    sums[i],
                    xxhash_rust::xxh64::xxh64(page, 0),
                    "{n} pages, page {i}"
                );
            }
        }
    }
}
