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
}
