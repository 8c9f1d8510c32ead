//! The sample index: which digests of new pages (see `ebpf::sampler`) some other page of the
//! merge domain shares.
//!
//! Per digest it counts the pages read whole that have it, and keeps at most one page that
//! was only sampled. A new page whose digest has no entry is only sampled: never copied,
//! never checksummed, never in the [`Index`](super::index::Index). One whose digest has an
//! entry is read whole, and so is the page only sampled there (it is taken out to be read):
//! only then do checksums and byte compares decide what is a duplicate. An entry costs 16
//! bytes (the digest, the count, the sampled page packed as pid and page number).

use std::collections::HashMap;

use rksm_common::PAGE_SIZE;

use std::hash::BuildHasherDefault;

use super::{index::PageRef, keys::KeyHasher, pages::DigestChange};

/// Bits of a packed page for its page number (47-bit user addresses need 35).
const PAGE_BITS: u32 = 36;

/// What a new page's digest meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meets {
    /// No other page: it is only sampled.
    Nothing,
    /// Pages read whole, or being read this pass: it is read whole.
    Company,
    /// A page only sampled so far, which is now to be read whole too.
    Sampled(PageRef),
}

#[derive(Debug, Default)]
pub struct SampleIndex {
    /// Digest → (pages read whole counted, the page only sampled packed, [`READING`], or 0).
    slots: HashMap<u32, (u32, u64), BuildHasherDefault<KeyHasher>>,
}

/// In place of a page only sampled: pages of this digest are being read whole this pass, and
/// are not counted yet.
const READING: u64 = u64::MAX;

fn pack(page: PageRef) -> u64 {
    (u64::from(page.pid) << PAGE_BITS) | (page.addr / PAGE_SIZE)
}

fn unpack(packed: u64) -> PageRef {
    PageRef {
        pid: (packed >> PAGE_BITS) as u32,
        addr: (packed & ((1 << PAGE_BITS) - 1)) * PAGE_SIZE,
    }
}

impl SampleIndex {
    /// What a new page `page` with `digest` meets. Nothing: it is kept as the digest's page
    /// only sampled. A page only sampled there is handed back (forgotten here) to be read
    /// whole with this one; the digest is then marked as being read until a page of it is
    /// counted, so that further pages with it are read whole too.
    pub fn meet(&mut self, digest: u32, page: PageRef) -> Meets {
        // One probe of the table (a trip to memory when it is large).
        let slot = self.slots.entry(digest).or_insert((0, 0));
        match slot.1 {
            0 if slot.0 == 0 => {
                slot.1 = pack(page);
                Meets::Nothing
            }
            READING | 0 => Meets::Company,
            // Its own old entry (a page sampled again).
            packed if packed == pack(page) && slot.0 == 0 => Meets::Nothing,
            packed if packed == pack(page) => {
                slot.1 = 0;
                Meets::Company
            }
            packed => {
                slot.1 = READING;
                Meets::Sampled(unpack(packed))
            }
        }
    }

    /// The page only sampled with `digest`, other than `page` (a page just read whole),
    /// taken out to be read whole too.
    pub fn take_sampled(&mut self, digest: u32, page: PageRef) -> Option<PageRef> {
        let slot = self.slots.get_mut(&digest)?;
        if matches!(slot.1, 0 | READING) || unpack(slot.1) == page {
            return None;
        }
        let other = unpack(std::mem::replace(&mut slot.1, READING));
        Some(other)
    }

    /// Follows `changes` of pid `pid`'s pages.
    pub fn follow(&mut self, pid: u32, changes: &[DigestChange]) {
        for &change in changes {
            match change {
                DigestChange::Counted(d) => {
                    let slot = self.slots.entry(d).or_insert((0, 0));
                    slot.0 += 1;
                    if slot.1 == READING {
                        slot.1 = 0;
                    }
                }
                DigestChange::Uncounted(d) => self.drop_count(d),
                DigestChange::Unsampled(addr, d) => {
                    if let Some(slot) = self.slots.get_mut(&d) {
                        if slot.1 == pack(PageRef { pid, addr }) {
                            slot.1 = 0;
                        }
                        if *slot == (0, 0) {
                            self.slots.remove(&d);
                        }
                    }
                }
            }
        }
    }

    fn drop_count(&mut self, digest: u32) {
        if let Some(slot) = self.slots.get_mut(&digest) {
            slot.0 = slot.0.saturating_sub(1);
            if slot.0 == 0 && matches!(slot.1, 0 | READING) {
                self.slots.remove(&digest);
            }
        }
    }

    /// Makes room for `n` more digests.
    pub fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
    }

    /// Digests kept.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no digest is kept.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(pid: u32, n: u64) -> PageRef {
        PageRef {
            pid,
            addr: 0x7f00_0000_0000 + n * PAGE_SIZE,
        }
    }

    #[test]
    fn a_lone_digest_is_kept_sampled_and_handed_back_when_a_second_page_has_it() {
        let mut index = SampleIndex::default();
        assert_eq!(index.meet(7, page(1, 0)), Meets::Nothing);
        assert_eq!(index.meet(7, page(1, 0)), Meets::Nothing, "itself again");
        assert_eq!(index.meet(7, page(2, 0)), Meets::Sampled(page(1, 0)));
        // Being read: a third page of the same pass is read too.
        assert_eq!(index.meet(7, page(3, 0)), Meets::Company);
        // Once read and counted, later pages meet them.
        index.follow(1, &[DigestChange::Counted(7)]);
        index.follow(2, &[DigestChange::Counted(7)]);
        assert_eq!(index.meet(7, page(4, 0)), Meets::Company);
        index.follow(1, &[DigestChange::Uncounted(7)]);
        index.follow(2, &[DigestChange::Uncounted(7)]);
        assert!(index.is_empty(), "gone with its last counted page");
    }

    #[test]
    fn a_page_read_whole_takes_the_page_only_sampled_with_its_digest_once() {
        let mut index = SampleIndex::default();
        assert_eq!(index.meet(3, page(1, 9)), Meets::Nothing);
        assert_eq!(index.take_sampled(3, page(1, 9)), None, "not itself");
        assert_eq!(index.take_sampled(3, page(2, 9)), Some(page(1, 9)));
        assert_eq!(index.take_sampled(3, page(3, 9)), None);
        assert_eq!(index.meet(3, page(4, 9)), Meets::Company);
    }

    #[test]
    fn a_digest_is_forgotten_when_its_last_page_leaves() {
        let mut index = SampleIndex::default();
        index.follow(1, &[DigestChange::Counted(5)]);
        index.follow(1, &[DigestChange::Uncounted(5)]);
        assert!(index.is_empty());
        assert_eq!(index.meet(6, page(1, 1)), Meets::Nothing);
        // Another page's leaving does not take the sampled page out.
        index.follow(2, &[DigestChange::Unsampled(page(2, 1).addr, 6)]);
        assert_eq!(index.len(), 1);
        index.follow(1, &[DigestChange::Unsampled(page(1, 1).addr, 6)]);
        assert!(index.is_empty());
    }

    #[test]
    fn packed_pages_round_trip() {
        let p = PageRef {
            pid: 4_194_304,
            addr: 0x7fff_ffff_f000,
        };
        assert_eq!(unpack(pack(p)), p);
    }
}
