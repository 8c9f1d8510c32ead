//! Where the index keeps its contents: one page's alone, several pages' as a class.
//!
//! Once duplicates abound, classes are most of what rksm holds: one per duplicated content,
//! for as long as its copies stay merged. So a class is laid out for its usual size, a few
//! pages: up to four sit in the class itself, eight bytes a page, and a class moves its pages
//! to a list, then a set, only as it grows. Classes live in chunks of slots rather than one
//! allocation each, a class keeping its checksum (chunks of a fixed size, so that a first pass
//! that makes hundreds of thousands of classes never copies them into a vector twice the size,
//! nor holds both while it does), and the table that finds them holds a
//! slot and half its checksum's hash ([`Table`], eight bytes an entry): one entry per class,
//! several for a checksum that several contents have (a collision, rare). A class that goes
//! leaves its slot to the next one made. Contents held by one page, by far the most when new
//! pages are read whole, are kept apart in 16 bytes each.

use std::collections::HashSet;

use super::PageRef;
use crate::engine::{
    keys::BuildKeyHasher,
    table::{mix, Table},
};

/// Pages held in the class itself.
const INLINE: usize = 4;
/// A class's page list becomes a set past this many pages, so leaving it stays O(1).
const FEW: usize = 32;

/// A page in eight bytes: its pid (below 2^22, Linux's largest `pid_max`) above its page
/// number, for an address below 2^54 (all the user space of 4-level paging). A class with a
/// page past that keeps its pages in a list ([`Members::Few`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Packed(u64);

const PID_BITS: u32 = 22;
const NUMBER_BITS: u32 = 42;
const PAGE_SHIFT: u32 = 12;

impl Packed {
    fn new(page: PageRef) -> Option<Self> {
        let number = page.addr >> PAGE_SHIFT;
        (page.pid < 1 << PID_BITS
            && number < 1 << NUMBER_BITS
            && page.addr & ((1 << PAGE_SHIFT) - 1) == 0)
            .then(|| Packed((u64::from(page.pid) << NUMBER_BITS) | number))
    }

    fn page(self) -> PageRef {
        PageRef {
            pid: (self.0 >> NUMBER_BITS) as u32,
            addr: (self.0 & ((1 << NUMBER_BITS) - 1)) << PAGE_SHIFT,
        }
    }
}

/// The pages of a class, the first of them its representative.
#[derive(Debug, Clone)]
pub(super) enum Members {
    /// Up to [`INLINE`] pages, in order, each of which packs.
    Inline { len: u8, pages: [Packed; INLINE] },
    /// Up to [`FEW`] pages, in order.
    Few(Vec<PageRef>),
    /// More, with the representative apart.
    Many(Box<ManyPages>),
}

/// The pages of a large class.
#[derive(Debug, Clone)]
pub(super) struct ManyPages {
    rep: PageRef,
    all: HashSet<PageRef, BuildKeyHasher>,
}

impl Members {
    /// One page.
    fn one(page: PageRef) -> Self {
        match Packed::new(page) {
            Some(packed) => {
                let mut pages = [Packed::default(); INLINE];
                pages[0] = packed;
                Members::Inline { len: 1, pages }
            }
            None => Members::Few(vec![page]),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Members::Inline { len, .. } => usize::from(*len),
            Members::Few(v) => v.len(),
            Members::Many(many) => many.all.len(),
        }
    }

    pub(super) fn rep(&self) -> Option<PageRef> {
        match self {
            Members::Inline { len: 0, .. } => None,
            Members::Inline { pages, .. } => Some(pages[0].page()),
            Members::Few(v) => v.first().copied(),
            Members::Many(many) => Some(many.rep),
        }
    }

    /// The page `page` has for company here: the representative if that is not `page`,
    /// else another member; `None` if there is no other.
    pub(super) fn company_of(&self, page: PageRef) -> Option<PageRef> {
        match self.rep() {
            Some(rep) if rep != page => Some(rep),
            _ => self.iter().find(|&p| p != page),
        }
    }

    pub(super) fn add(&mut self, page: PageRef) {
        match self {
            Members::Inline { len, pages } if usize::from(*len) < INLINE => {
                match Packed::new(page) {
                    Some(packed) => {
                        pages[usize::from(*len)] = packed;
                        *len += 1;
                    }
                    None => {
                        let mut all: Vec<PageRef> = self.iter().collect();
                        all.push(page);
                        *self = Members::Few(all);
                    }
                }
            }
            Members::Inline { .. } => {
                let mut all: Vec<PageRef> = self.iter().collect();
                all.push(page);
                *self = Members::Few(all);
            }
            Members::Few(v) if v.len() < FEW => v.push(page),
            Members::Few(v) => {
                let rep = v[0];
                let mut all: HashSet<PageRef, BuildKeyHasher> = v.drain(..).collect();
                all.insert(page);
                *self = Members::Many(Box::new(ManyPages { rep, all }));
            }
            Members::Many(many) => {
                many.all.insert(page);
            }
        }
    }

    /// Takes `page` out; false if it was not there.
    pub(super) fn remove(&mut self, page: PageRef) -> bool {
        match self {
            Members::Inline { len, pages } => {
                let held = &mut pages[..usize::from(*len)];
                let Some(i) = held.iter().position(|&p| p.page() == page) else {
                    return false;
                };
                held.copy_within(i + 1.., i);
                *len -= 1;
                true
            }
            Members::Few(v) => match v.iter().position(|&p| p == page) {
                Some(i) => {
                    v.remove(i);
                    true
                }
                None => false,
            },
            Members::Many(many) => {
                if !many.all.remove(&page) {
                    return false;
                }
                if many.rep == page {
                    if let Some(&next) = many.all.iter().next() {
                        many.rep = next;
                    }
                }
                true
            }
        }
    }

    pub(super) fn contains(&self, page: PageRef) -> bool {
        match self {
            Members::Inline { len, pages } => {
                pages[..usize::from(*len)].iter().any(|&p| p.page() == page)
            }
            Members::Few(v) => v.contains(&page),
            Members::Many(many) => many.all.contains(&page),
        }
    }

    pub(super) fn iter(&self) -> Box<dyn Iterator<Item = PageRef> + '_> {
        match self {
            Members::Inline { len, pages } => {
                Box::new(pages[..usize::from(*len)].iter().map(|&p| p.page()))
            }
            Members::Few(v) => Box::new(v.iter().copied()),
            Members::Many(many) => Box::new(many.all.iter().copied()),
        }
    }
}

/// Pages with one content (compared equal).
#[derive(Debug, Clone)]
pub(super) struct Class {
    pub(super) members: Members,
    /// One of its pages was a KSM page: the content is merged.
    pub(super) stable: bool,
    /// The all-zero content.
    pub(super) zero: bool,
    /// Its checksum, which the table finds it by.
    checksum: u64,
    /// The release round in which its representative was last listed as a candidate (see
    /// [`Index::company_to_list`](super::Index::company_to_list)); 0 for none.
    pub(super) listed: u32,
}

impl Class {
    /// What a free slot holds.
    fn vacant() -> Self {
        Class {
            members: Members::Inline {
                len: 0,
                pages: [Packed::default(); INLINE],
            },
            stable: false,
            zero: false,
            checksum: 0,
            listed: 0,
        }
    }
}

/// A content held by one page: 16 bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Single {
    addr: u64,
    pid: u32,
    pub(super) stable: bool,
    pub(super) zero: bool,
}

impl Single {
    pub(super) fn new(page: PageRef, stable: bool, zero: bool) -> Self {
        Single {
            addr: page.addr,
            pid: page.pid,
            stable,
            zero,
        }
    }

    pub(super) fn page(self) -> PageRef {
        PageRef {
            pid: self.pid,
            addr: self.addr,
        }
    }

    /// A class of this one page.
    pub(super) fn class(self) -> Class {
        Class {
            members: Members::one(self.page()),
            stable: self.stable,
            zero: self.zero,
            checksum: 0,
            listed: 0,
        }
    }
}

/// Slots of classes, in chunks of [`CHUNK`].
#[derive(Debug, Default)]
struct Slots {
    chunks: Vec<Vec<Class>>,
}

/// Slots a chunk holds: 224 KiB of classes.
const CHUNK: usize = 4096;

impl Slots {
    fn get(&self, at: u32) -> &Class {
        let at = at as usize;
        &self.chunks[at / CHUNK][at % CHUNK]
    }

    fn get_mut(&mut self, at: u32) -> &mut Class {
        let at = at as usize;
        &mut self.chunks[at / CHUNK][at % CHUNK]
    }

    /// Puts `class` in a new slot; returns it.
    fn push(&mut self, class: Class) -> u32 {
        if self.chunks.last().is_none_or(|c| c.len() == CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let full = (self.chunks.len() - 1) * CHUNK;
        let last = self.chunks.last_mut().expect("a chunk with room");
        last.push(class);
        (full + last.len() - 1) as u32
    }
}

/// Classes by checksum.
#[derive(Debug, Default)]
pub(super) struct Classes {
    /// Every class's entry: the high half of its checksum's hash, and its slot + 1.
    table: Table<u64>,
    slots: Slots,
    /// Slots no class holds.
    free: Vec<u32>,
}

/// The part of a hash an entry keeps: all the table needs to place the entry.
const HASH_HALF: u64 = 0xffff_ffff_0000_0000;

/// The table's entry for slot `at` of a class whose checksum hashes to `hash`.
fn entry(hash: u64, at: u32) -> u64 {
    (hash & HASH_HALF) | u64::from(at + 1)
}

/// The slot of the table's entry `entry`.
fn slot(entry: u64) -> usize {
    (entry & !HASH_HALF) as usize - 1
}

/// The hash of the checksum of entry `entry`, as far as the table needs it.
fn hash_of(entry: u64) -> u64 {
    entry & HASH_HALF
}

impl Classes {
    /// Whether some class has `checksum`.
    pub(super) fn holds(&self, checksum: u64) -> bool {
        self.slots(checksum).next().is_some()
    }

    /// Whether there are no classes.
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The slots of the classes with `checksum`.
    pub(super) fn slots(&self, checksum: u64) -> impl Iterator<Item = u32> + '_ {
        let hash = mix(checksum);
        self.table
            .matching(hash, move |e| {
                hash_of(e) == hash & HASH_HALF
                    && self.slots.get(slot(e) as u32).checksum == checksum
            })
            .map(|e| slot(e) as u32)
    }

    /// Fetches where the classes with `checksum` are listed, ahead of a lookup of it.
    pub(super) fn prefetch(&self, checksum: u64) {
        self.table.prefetch(mix(checksum));
    }

    /// The slot of the `rank`th class with `checksum`.
    pub(super) fn nth(&self, checksum: u64, rank: usize) -> Option<u32> {
        self.slots(checksum).nth(rank)
    }

    /// The class in `at`.
    pub(super) fn get(&self, at: u32) -> &Class {
        self.slots.get(at)
    }

    /// The class in `at`, to change.
    pub(super) fn get_mut(&mut self, at: u32) -> &mut Class {
        self.slots.get_mut(at)
    }

    /// Adds `class` with `checksum`; returns its slot.
    pub(super) fn add(&mut self, checksum: u64, mut class: Class) -> u32 {
        class.checksum = checksum;
        let at = match self.free.pop() {
            Some(at) => {
                *self.slots.get_mut(at) = class;
                at
            }
            None => self.slots.push(class),
        };
        let hash = mix(checksum);
        self.table.insert(hash, entry(hash, at), |_| false, hash_of);
        at
    }

    /// Takes the class in `at` (one with `checksum`) out, and returns it.
    pub(super) fn take(&mut self, checksum: u64, at: u32) -> Class {
        let hash = mix(checksum);
        let taken = self.table.remove(hash, |e| e == entry(hash, at), hash_of);
        debug_assert!(taken.is_some(), "slot {at} holds no class of {checksum:#x}");
        self.free.push(at);
        // A free slot holds no pages (a large class's set would stay allocated).
        std::mem::replace(self.slots.get_mut(at), Class::vacant())
    }

    /// Every class, with its checksum.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &Class)> + '_ {
        self.table.iter().map(move |e| {
            let class = self.slots.get(slot(e) as u32);
            (class.checksum, class)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(pid: u32, index: u64) -> PageRef {
        PageRef {
            pid,
            addr: 0x7fff_0000_0000 + index * 4096,
        }
    }

    #[test]
    fn a_class_of_a_few_pages_is_one_slot_of_56_bytes() {
        assert_eq!(size_of::<Packed>(), 8);
        assert_eq!(size_of::<Class>(), 56);
        assert_eq!(size_of::<Single>(), 16);
    }

    #[test]
    fn members_keep_their_order_and_their_representative_as_they_grow_and_shrink() {
        let mut members = Members::one(page(1, 0));
        for i in 1..40 {
            members.add(page(1, i));
            assert_eq!(members.len(), i as usize + 1);
            assert_eq!(members.rep(), Some(page(1, 0)));
        }
        assert!(matches!(members, Members::Many(_)));
        assert!(members.contains(page(1, 39)) && !members.contains(page(2, 0)));
        let mut small = Members::one(page(1, 0));
        for i in 1..4 {
            small.add(page(2, i));
        }
        assert!(matches!(small, Members::Inline { len: 4, .. }));
        assert!(small.remove(page(1, 0)));
        assert!(!small.remove(page(1, 0)), "removed twice");
        assert_eq!(small.rep(), Some(page(2, 1)), "the next page stands for it");
        assert_eq!(
            small.iter().collect::<Vec<_>>(),
            [page(2, 1), page(2, 2), page(2, 3)]
        );
    }

    #[test]
    fn pages_that_do_not_pack_keep_a_class_in_a_list_with_the_same_answers() {
        // The largest pid, a page at the top of 4-level paging's user space, and pages that
        // do not pack: above 2^54 (5-level paging), a pid past 2^22.
        let top = PageRef {
            pid: (1 << PID_BITS) - 1,
            addr: (1 << 47) - 4096,
        };
        assert_eq!(Packed::new(top).map(Packed::page), Some(top));
        let high = PageRef {
            pid: 3,
            addr: 1 << 55,
        };
        let big_pid = PageRef {
            pid: 1 << PID_BITS,
            addr: 0x1000,
        };
        assert_eq!(Packed::new(high), None);
        assert_eq!(Packed::new(big_pid), None);
        for odd in [high, big_pid] {
            // First in the class, or joining one held inline.
            let mut alone = Members::one(odd);
            assert!(matches!(alone, Members::Few(_)));
            alone.add(top);
            let mut joined = Members::one(top);
            joined.add(odd);
            assert!(matches!(joined, Members::Few(_)));
            for members in [&mut alone, &mut joined] {
                assert!(members.contains(odd) && members.contains(top));
                assert_eq!(members.len(), 2);
                assert!(members.remove(odd) && !members.contains(odd));
                assert_eq!(members.rep(), Some(top));
            }
        }
    }

    #[test]
    fn classes_past_a_chunk_keep_their_slots() {
        let mut classes = Classes::default();
        let n = CHUNK as u64 * 2 + 3;
        let at: Vec<u32> = (0..n)
            .map(|i| classes.add(i, Single::new(page(1, i), false, false).class()))
            .collect();
        assert_eq!(at, (0..n as u32).collect::<Vec<_>>());
        for i in [0, CHUNK as u64 - 1, CHUNK as u64, n - 1] {
            let slot = classes.slots(i).next().expect("found by its checksum");
            assert_eq!(classes.get(slot).members.rep(), Some(page(1, i)));
        }
        assert_eq!(
            classes.take(CHUNK as u64, CHUNK as u32).members.rep(),
            Some(page(1, CHUNK as u64))
        );
        assert_eq!(
            classes.add(n, Single::new(page(2, 0), false, false).class()),
            CHUNK as u32
        );
        assert_eq!(classes.iter().count(), n as usize);
    }

    #[test]
    fn classes_of_one_checksum_are_all_found_and_their_slots_are_reused() {
        let mut classes = Classes::default();
        let one = |pid| Single::new(page(pid, 0), false, false).class();
        let (a, b, c) = (
            classes.add(7, one(1)),
            classes.add(7, one(2)),
            classes.add(8, one(3)),
        );
        let mut of_7: Vec<u32> = classes.slots(7).collect();
        of_7.sort_unstable();
        assert_eq!(of_7, [a, b]);
        assert_eq!(classes.slots(8).collect::<Vec<_>>(), [c]);
        assert_eq!(classes.take(7, a).members.rep(), Some(page(1, 0)));
        assert_eq!(classes.slots(7).collect::<Vec<_>>(), [b]);
        assert_eq!(classes.add(9, one(4)), a, "the free slot is taken again");
        classes.take(7, b);
        assert!(!classes.holds(7) && classes.holds(8) && classes.holds(9));
        assert_eq!(classes.iter().count(), 2);
        classes.take(8, c);
        classes.take(9, a);
        assert!(classes.is_empty());
    }
}
