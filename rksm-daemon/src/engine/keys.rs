//! Hashing for the maps the engine fills with a million keys a pass: checksums, page addresses
//! and pages (a pid and an address).
//!
//! The standard library's SipHash resists keys chosen to collide, which these keys are not:
//! a checksum is a hash already, and a page address is the process's own layout, not chosen
//! against rksm. Per key, SipHash costs more than the lookup it serves (a placement does three
//! or four lookups). One 64x64→128-bit multiply, its halves folded, mixes both ends of the
//! key, so page-aligned addresses (low 12 bits zero) and 32-bit crc32c checksums spread over
//! the buckets and the control bytes alike.

use std::{
    collections::{HashMap, HashSet},
    hash::{BuildHasherDefault, Hasher},
};

/// Hashes one `u64` key (other writes are folded in eight bytes at a time).
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

const K: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, key: u64) {
        let product = u128::from(self.0 ^ key ^ K) * u128::from(K.rotate_left(29));
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }
}

/// Builds [`KeyHasher`]s.
pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;
/// A map keyed by checksums or page addresses.
pub type KeyMap<V> = HashMap<u64, V, BuildKeyHasher>;
/// A set of checksums or page addresses.
pub type KeySet = HashSet<u64, BuildKeyHasher>;
/// A map keyed by process id, for what a pass collects page by page for each target.
pub type PidMap<V> = HashMap<u32, V, BuildKeyHasher>;

/// Pages per block of a [`PageSet`].
const BLOCK_PAGES: u64 = 64;
const PAGE_SHIFT: u32 = 12;

/// A set of page addresses, kept as one 64-bit mask per block of 64 pages that holds any.
///
/// Pages that ksmd merges come in runs (a duplicated buffer, a guest's zeroed RAM), so a
/// block holds many of them and a page costs a bit rather than a hash table's 16-odd bytes.
/// A set of pages scattered one per block costs about what a [`KeySet`] does.
#[derive(Debug, Default, Clone)]
pub struct PageSet {
    blocks: KeyMap<u64>,
    len: usize,
}

fn block_of(page: u64) -> (u64, u64) {
    let index = page >> PAGE_SHIFT;
    (index / BLOCK_PAGES, 1 << (index % BLOCK_PAGES))
}

impl PageSet {
    /// Adds page `page`; true if it was not in the set.
    pub fn insert(&mut self, page: u64) -> bool {
        let (block, bit) = block_of(page);
        let mask = self.blocks.entry(block).or_insert(0);
        let new = *mask & bit == 0;
        *mask |= bit;
        self.len += usize::from(new);
        new
    }

    /// Takes page `page` out; true if it was in the set.
    pub fn remove(&mut self, page: u64) -> bool {
        let (block, bit) = block_of(page);
        let Some(mask) = self.blocks.get_mut(&block) else {
            return false;
        };
        let was = *mask & bit != 0;
        *mask &= !bit;
        if *mask == 0 {
            self.blocks.remove(&block);
        }
        self.len -= usize::from(was);
        was
    }

    /// Whether page `page` is in the set.
    pub fn contains(&self, page: u64) -> bool {
        let (block, bit) = block_of(page);
        self.blocks.get(&block).is_some_and(|mask| mask & bit != 0)
    }

    /// Pages in the set.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Extend<u64> for PageSet {
    fn extend<I: IntoIterator<Item = u64>>(&mut self, pages: I) {
        for page in pages {
            self.insert(page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn page_addresses_and_small_checksums_spread_over_buckets_and_control_bytes() {
        let build = BuildKeyHasher::default();
        for keys in [
            (0..4096u64)
                .map(|i| 0x7f00_0000_0000 + i * 4096)
                .collect::<Vec<_>>(),
            (0..4096u64).map(|i| i * 0x1_0001).collect(),
        ] {
            let hashes: Vec<u64> = keys.iter().map(|k| build.hash_one(k)).collect();
            let buckets: HashSet<u64> = hashes.iter().map(|h| h & 4095).collect();
            let control: HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
            assert!(buckets.len() > 2500, "{} buckets of 4096", buckets.len());
            assert_eq!(control.len(), 128, "every control byte value is used");
        }
    }

    #[test]
    fn a_page_set_holds_each_page_once_and_a_run_in_a_few_blocks() {
        let mut set = PageSet::default();
        let run = (0..1000u64).map(|i| 0x7f00_0000_0000 + i * 4096);
        set.extend(run.clone());
        set.extend(run.clone());
        assert_eq!(set.len(), 1000);
        assert!(
            set.blocks.len() <= 17,
            "{} blocks for 1000 pages",
            set.blocks.len()
        );
        assert!(set.contains(0x7f00_0000_0000 + 999 * 4096));
        assert!(!set.contains(0x7f00_0000_0000 + 1000 * 4096));
        assert!(set.remove(0x7f00_0000_0000));
        assert!(!set.remove(0x7f00_0000_0000), "already out");
        assert!(!set.contains(0x7f00_0000_0000));
        for page in run {
            set.remove(page);
        }
        assert!(set.is_empty());
        assert!(set.blocks.is_empty(), "an empty block is dropped");
    }
}
