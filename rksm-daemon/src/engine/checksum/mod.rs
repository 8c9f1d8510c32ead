//! Page checksums: the gate in front of the unstable tree.
//!
//! KSM checksums a page only to ask "did it change since the last pass?"; a page whose
//! checksum moved is volatile and stays out of the unstable tree. rksm keeps that rule and
//! offers the two fast choices the kernel discussed: xxh64 (the kernel's choice since 4.20)
//! and crc32c (faster with SSE4.2, but weaker: about 78,000 random pages give a 51% chance of a
//! collision). A checksum never decides a merge: contents are always compared. jhash2 is here
//! only as a faithful port of KSM's original checksum, for the benchmark.

use rksm_common::PAGE;

pub mod wide;

/// Which checksum rksm computes per page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ChecksumKind {
    /// xxh64, seed 0 (KSM since Linux 4.20).
    #[default]
    Xxh64,
    /// crc32c (Castagnoli), hardware-accelerated where the CPU has it.
    Crc32c,
}

/// A page checksum function.
pub type PageChecksum = fn(&[u8]) -> u64;

/// The value no page checksum ever takes: "no checksum recorded yet".
pub const NO_CHECKSUM: u64 = u64::MAX;

impl ChecksumKind {
    /// The checksum of `page`; never [`NO_CHECKSUM`].
    ///
    /// ```
    /// use rksm::engine::checksum::ChecksumKind;
    /// let page = [7u8; 4096];
    /// assert_eq!(ChecksumKind::Xxh64.checksum(&page), ChecksumKind::Xxh64.checksum(&[7u8; 4096]));
    /// assert_ne!(ChecksumKind::Crc32c.checksum(&page), ChecksumKind::Crc32c.checksum(&[8u8; 4096]));
    /// ```
    #[inline]
    pub fn checksum(self, page: &[u8]) -> u64 {
        let value = match self {
            ChecksumKind::Xxh64 => xxhash_rust::xxh64::xxh64(page, 0),
            ChecksumKind::Crc32c => u64::from(crc32c::crc32c(page)),
        };
        // Folding one xxh64 value onto its neighbour costs nothing: contents are compared.
        value.min(NO_CHECKSUM - 1)
    }

    /// The checksum of each of `pages` into `sums` (one per page), as
    /// [`ChecksumKind::checksum`] gives it: xxh64 hashes many pages side by side where the
    /// CPU can (see [`wide`]).
    pub fn checksum_pages(self, pages: &[&[u8; PAGE]], sums: &mut [u64]) {
        assert_eq!(pages.len(), sums.len());
        match self {
            ChecksumKind::Xxh64 if wide::available() => {
                wide::xxh64_pages(pages, sums);
                for sum in sums.iter_mut() {
                    *sum = (*sum).min(NO_CHECKSUM - 1);
                }
            }
            _ => {
                for (page, sum) in pages.iter().zip(sums.iter_mut()) {
                    *sum = self.checksum(*page);
                }
            }
        }
    }

    /// [`ChecksumKind::checksum`] as a plain function, for code that takes any page checksum.
    pub fn function(self) -> PageChecksum {
        match self {
            ChecksumKind::Xxh64 => |page| ChecksumKind::Xxh64.checksum(page),
            ChecksumKind::Crc32c => |page| ChecksumKind::Crc32c.checksum(page),
        }
    }
}

crate::value_enum_text!(ChecksumKind => "checksum");

/// The kernel's `jhash2(k, length, initval)` (include/linux/jhash.h), as KSM called it before
/// 4.20: `jhash2(page, PAGE_SIZE / 4, 17)`. For benchmarks only.
pub fn jhash2(words: &[u32], initval: u32) -> u32 {
    const JHASH_INITVAL: u32 = 0xdead_beef;
    let init = JHASH_INITVAL
        .wrapping_add((words.len() as u32) << 2)
        .wrapping_add(initval);
    let (mut a, mut b, mut c) = (init, init, init);
    let mut k = words;
    while k.len() > 3 {
        a = a.wrapping_add(k[0]);
        b = b.wrapping_add(k[1]);
        c = c.wrapping_add(k[2]);
        jhash_mix(&mut a, &mut b, &mut c);
        k = &k[3..];
    }
    match k.len() {
        3 => {
            c = c.wrapping_add(k[2]);
            b = b.wrapping_add(k[1]);
            a = a.wrapping_add(k[0]);
            jhash_final(&mut a, &mut b, &mut c);
        }
        2 => {
            b = b.wrapping_add(k[1]);
            a = a.wrapping_add(k[0]);
            jhash_final(&mut a, &mut b, &mut c);
        }
        1 => {
            a = a.wrapping_add(k[0]);
            jhash_final(&mut a, &mut b, &mut c);
        }
        _ => {}
    }
    c
}

#[inline(always)]
fn jhash_mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(4);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(6);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(8);
    *b = b.wrapping_add(*a);
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(16);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(19);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(4);
    *b = b.wrapping_add(*a);
}

#[inline(always)]
fn jhash_final(a: &mut u32, b: &mut u32, c: &mut u32) {
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(14));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(11));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(25));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(16));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(4));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(14));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(24));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        // Reference values: xxh64("", 0) and crc32c("123456789") from their specifications.
        assert_eq!(ChecksumKind::Xxh64.checksum(b""), 0xef46_db37_51d8_e999);
        assert_eq!(ChecksumKind::Crc32c.checksum(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn jhash2_matches_the_kernel() {
        // Computed with include/linux/jhash.h's jhash2 compiled as C.
        assert_eq!(jhash2(&[], 0), 0xdead_beef);
        assert_eq!(jhash2(&[1], 0), 0x72a8_2a9b);
        assert_eq!(jhash2(&[1, 2], 0), 0x8b4c_7979);
        assert_eq!(jhash2(&[1, 2, 3], 0), 0xa461_58f5);
        assert_eq!(jhash2(&[0u32; 1024], 17), 0x6157_4272);
        let page: Vec<u32> = (0..1024u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        assert_eq!(jhash2(&page, 17), 0xec16_3194);
    }

    #[test]
    fn parses_names_and_rejects_others() {
        assert_eq!(
            "xxh64".parse::<ChecksumKind>().unwrap(),
            ChecksumKind::Xxh64
        );
        assert_eq!(
            "crc32c".parse::<ChecksumKind>().unwrap(),
            ChecksumKind::Crc32c
        );
        assert!("jhash2".parse::<ChecksumKind>().is_err());
        assert_eq!(ChecksumKind::default(), ChecksumKind::Xxh64);
    }

    #[test]
    fn pages_checksummed_together_have_their_own_checksums() {
        let pages: Vec<[u8; PAGE]> = (0..40u8).map(|i| [i.wrapping_mul(37); PAGE]).collect();
        let refs: Vec<&[u8; PAGE]> = pages.iter().collect();
        for kind in [ChecksumKind::Xxh64, ChecksumKind::Crc32c] {
            let mut sums = vec![0; refs.len()];
            kind.checksum_pages(&refs, &mut sums);
            for (page, sum) in pages.iter().zip(&sums) {
                assert_eq!(*sum, kind.checksum(page), "{kind}");
            }
        }
    }

    #[test]
    fn never_returns_the_sentinel() {
        for kind in [ChecksumKind::Xxh64, ChecksumKind::Crc32c] {
            for fill in 0..=255u8 {
                assert_ne!(kind.checksum(&[fill; 4096]), NO_CHECKSUM);
            }
        }
    }
}
