//! What rksm knows about one target's pages, kept from pass to pass, for present pages only.
//!
//! A steady pass must cost what the writes cost, so the scan does not look at a clean page
//! again: it needs, for every page it once hashed, the checksum and whether the page sits in
//! the index (placed) or waits for the checksum gate (pending). That is kept here, in chunks
//! of 64 pages that exist only where a page is present: 12.8 bytes per page of dense memory,
//! and a sparse mapping (a 1 TiB `MAP_NORESERVE` arena, a sanitizer's shadow) costs at most
//! one 816-byte chunk per present page, never anything per virtual page. `scanned` says which
//! ranges were read in full at some pass, so that their absent pages are known absent.
//!
//! Where new pages are sampled (see `ebpf::sampler`), a chunk also keeps each page's digest:
//! of a page only sampled (not read, not in the index, counted in the domain's
//! [`SampleIndex`](super::samples::SampleIndex)), and of a page read whole whose digest the
//! sample index counts. A chunk of pages only sampled keeps no checksums: 4.8 bytes a page.
//! Every change to those is queued here as a [`DigestChange`] for the scanner to apply to
//! the sample index, so that no path that forgets a page forgets it there.
//!
//! A duplicate found when its page was first read waits a pass for the gate; it is held here
//! too, as one bit of its chunk (the checksum is the chunk's already), not as an entry of a
//! list of its own: a first pass holds hundreds of thousands of them.

use std::collections::{BTreeMap, BTreeSet};

use rksm_common::PAGE_SIZE;

use crate::kernel::{
    procfs::Vma,
    ranges::{Range, RangeSet},
};

/// Pages per chunk: one bit each in a `u64` mask.
const CHUNK_PAGES: u64 = 64;
const CHUNK_SPAN: u64 = CHUNK_PAGES * PAGE_SIZE;

/// What is known about one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageInfo {
    /// Its checksum when it was last hashed.
    pub checksum: u64,
    /// Whether it is in the index (else it waits for the gate: it was hashed once).
    pub placed: bool,
}

/// A page read whole, to be recorded: see [`PageState::record_all`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub addr: u64,
    pub info: PageInfo,
    /// Its sample's digest, to be counted in the sample index.
    pub digest: Option<u32>,
    /// Whether it is held for the gate.
    pub held: bool,
}

#[derive(Debug)]
struct Chunk {
    /// Checksums of the known pages: only where the chunk has one (a chunk of pages only
    /// sampled holds their digests alone).
    checksums: Option<Box<[u64; CHUNK_PAGES as usize]>>,
    /// Pages with a checksum.
    known: u64,
    /// Pages in the index.
    placed: u64,
    /// Digests of the `tracked` and `sampled` pages.
    digests: [u32; CHUNK_PAGES as usize],
    /// Known pages whose digest the sample index counts.
    tracked: u64,
    /// Pages only sampled: not known, their digest in the sample index.
    sampled: u64,
    /// Known pages held for the gate.
    held: u64,
}

impl Chunk {
    fn new() -> Box<Self> {
        Box::new(Chunk {
            checksums: None,
            known: 0,
            placed: 0,
            digests: [0; CHUNK_PAGES as usize],
            tracked: 0,
            sampled: 0,
            held: 0,
        })
    }

    fn is_empty(&self) -> bool {
        self.known == 0 && self.sampled == 0
    }

    fn checksum(&self, slot: usize) -> u64 {
        self.checksums.as_ref().map_or(0, |c| c[slot])
    }

    /// What is known about the page in `slot`, if anything.
    fn info(&self, slot: usize) -> Option<PageInfo> {
        (self.known >> slot & 1 == 1).then(|| PageInfo {
            checksum: self.checksum(slot),
            placed: self.placed >> slot & 1 == 1,
        })
    }
}

/// A change the sample index must follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestChange {
    /// A page read whole, with this digest, is counted.
    Counted(u32),
    /// A counted page left.
    Uncounted(u32),
    /// The page only sampled at this address, with this digest, left.
    Unsampled(u64, u32),
}

impl DigestChange {
    /// The digest it changes the count of.
    pub fn digest(self) -> u32 {
        match self {
            DigestChange::Counted(d)
            | DigestChange::Uncounted(d)
            | DigestChange::Unsampled(_, d) => d,
        }
    }
}

impl Chunk {
    /// Pages hashed once, not yet placed: the next pass places them if they stayed clean.
    fn pending(&self) -> u64 {
        self.known & !self.placed
    }
}

/// The pages of one target, as of its last pass.
#[derive(Debug, Default)]
pub struct PageState {
    chunks: BTreeMap<u64, Box<Chunk>>,
    /// Chunks with a pending page (the pages themselves are the chunk's known and unplaced
    /// bits). A set of chunks, not of pages: a hash-only pass leaves every page pending, and
    /// a B-tree entry per page made its first pass 10% slower; yet a steady ebpf pass still
    /// finds its few pending pages without walking every chunk.
    pending_chunks: BTreeSet<u64>,
    /// Ranges read in full at some pass (clipped to the VMAs of the last pass).
    pub(crate) scanned: RangeSet,
    len: u64,
    /// Pages only sampled.
    sampled: u64,
    /// What the sample index has not been told yet.
    changes: Vec<DigestChange>,
    /// Chunks given a held page since the last take, in the order they were (some twice,
    /// some with none left).
    held_chunks: Vec<u64>,
}

/// Keeps chunk `key` listed among the chunks with a pending page when it has come to hold
/// one, and off the list when its last one has gone.
fn list_pending(pending_chunks: &mut BTreeSet<u64>, key: u64, had: bool, has: bool) {
    match (had, has) {
        (false, true) => {
            pending_chunks.insert(key);
        }
        (true, false) => {
            pending_chunks.remove(&key);
        }
        _ => {}
    }
}

/// Queues what the sample index knows of page `slot` of `chunk` (at `addr`) to be forgotten,
/// and forgets it here.
fn release(
    chunk: &mut Chunk,
    slot: usize,
    addr: u64,
    changes: &mut Vec<DigestChange>,
    sampled: &mut u64,
) {
    let bit = 1u64 << slot;
    if chunk.tracked & bit != 0 {
        chunk.tracked &= !bit;
        changes.push(DigestChange::Uncounted(chunk.digests[slot]));
    }
    if chunk.sampled & bit != 0 {
        chunk.sampled &= !bit;
        *sampled -= 1;
        changes.push(DigestChange::Unsampled(addr, chunk.digests[slot]));
    }
}

/// The held pages of a [`PageState`], taken in address order: see [`PageState::take_held`].
pub struct TakenHeld<'a> {
    state: &'a mut PageState,
    /// Chunks still to look at.
    keys: std::vec::IntoIter<u64>,
    /// The chunk being given, and its held pages not given yet.
    key: u64,
    bits: u64,
}

impl Iterator for TakenHeld<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        loop {
            if self.bits != 0 {
                let slot = self.bits.trailing_zeros() as usize;
                self.bits &= self.bits - 1;
                let chunk = self.state.chunks.get_mut(&self.key)?;
                chunk.held &= !(1 << slot);
                return Some((
                    self.key * CHUNK_SPAN + slot as u64 * PAGE_SIZE,
                    chunk.checksum(slot),
                ));
            }
            self.key = self.keys.next()?;
            self.bits = self
                .state
                .chunks
                .get(&self.key)
                .map_or(0, |c| c.held & c.known);
        }
    }
}

impl Drop for TakenHeld<'_> {
    /// What was not given stays held, listed for the next take.
    fn drop(&mut self) {
        if self.bits != 0 {
            self.state.held_chunks.push(self.key);
        }
        self.state.held_chunks.extend(self.keys.by_ref());
    }
}

fn split(addr: u64) -> (u64, usize) {
    (
        addr / CHUNK_SPAN,
        ((addr % CHUNK_SPAN) / PAGE_SIZE) as usize,
    )
}

impl PageState {
    /// Pages with a checksum.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing is known.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What is known about the page at `addr`.
    pub fn get(&self, addr: u64) -> Option<PageInfo> {
        let (key, slot) = split(addr);
        self.chunks.get(&key)?.info(slot)
    }

    /// What is known about those of `addrs` that are known, in their order: [`PageState::get`]
    /// of each, with one chunk lookup per run of addresses in one chunk.
    pub fn known_at(&self, addrs: impl IntoIterator<Item = u64>) -> Vec<(u64, PageInfo)> {
        let mut known = Vec::new();
        let mut last: Option<(u64, Option<&Chunk>)> = None;
        for addr in addrs {
            let (key, slot) = split(addr);
            let chunk = match last {
                Some((at, chunk)) if at == key => chunk,
                _ => {
                    let chunk = self.chunks.get(&key).map(|c| &**c);
                    last = Some((key, chunk));
                    chunk
                }
            };
            if let Some(info) = chunk.and_then(|c| c.info(slot)) {
                known.push((addr, info));
            }
        }
        known
    }

    /// Records the page at `addr`.
    pub fn set(&mut self, addr: u64, info: PageInfo) {
        self.set_with_digest(addr, info, None);
    }

    /// Records the page at `addr`, read whole, and counts its digest if it has one.
    pub fn set_with_digest(&mut self, addr: u64, info: PageInfo, digest: Option<u32>) {
        self.record_all(&[Record {
            addr,
            info,
            digest,
            held: false,
        }]);
    }

    /// Records the pages of `records`, each as [`PageState::set_with_digest`] does, and holds
    /// those it says are held, as [`PageState::hold`] does: a batch's pages, in address
    /// order, with one chunk lookup per chunk rather than two per page.
    pub fn record_all(&mut self, records: &[Record]) {
        let mut i = 0;
        while i < records.len() {
            let (key, _) = split(records[i].addr);
            let chunk = self.chunks.entry(key).or_insert_with(Chunk::new);
            let had_pending = chunk.pending() != 0;
            let had_held = chunk.held != 0;
            while let Some(record) = records.get(i).filter(|r| split(r.addr).0 == key) {
                let slot = split(record.addr).1;
                let bit = 1u64 << slot;
                if chunk.known & bit == 0 {
                    self.len += 1;
                }
                release(
                    chunk,
                    slot,
                    record.addr,
                    &mut self.changes,
                    &mut self.sampled,
                );
                chunk.known |= bit;
                chunk
                    .checksums
                    .get_or_insert_with(|| Box::new([0; CHUNK_PAGES as usize]))[slot] =
                    record.info.checksum;
                if record.info.placed {
                    chunk.placed |= bit;
                } else {
                    chunk.placed &= !bit;
                }
                if let Some(digest) = record.digest {
                    chunk.tracked |= bit;
                    chunk.digests[slot] = digest;
                    self.changes.push(DigestChange::Counted(digest));
                }
                if record.held {
                    chunk.held |= bit;
                }
                i += 1;
            }
            if !had_held && chunk.held != 0 {
                self.held_chunks.push(key);
            }
            list_pending(
                &mut self.pending_chunks,
                key,
                had_pending,
                chunk.pending() != 0,
            );
        }
    }

    /// Records pages `addrs` (ascending, none known) as only sampled, with `digests` (the
    /// caller counted them in the sample index); one chunk lookup per chunk.
    pub fn set_sampled(&mut self, addrs: &[u64], digests: &[u32]) {
        let mut i = 0;
        while i < addrs.len() {
            let (key, _) = split(addrs[i]);
            let chunk = self.chunks.entry(key).or_insert_with(Chunk::new);
            while i < addrs.len() && split(addrs[i]).0 == key {
                let slot = split(addrs[i]).1;
                let bit = 1u64 << slot;
                debug_assert!(chunk.known & bit == 0, "a known page is not sampled");
                if chunk.sampled & bit == 0 {
                    self.sampled += 1;
                }
                chunk.sampled |= bit;
                chunk.digests[slot] = digests[i];
                i += 1;
            }
        }
    }

    /// The digest of the page at `addr` if it is only sampled.
    pub fn sampled_digest(&self, addr: u64) -> Option<u32> {
        let (key, slot) = split(addr);
        let chunk = self.chunks.get(&key)?;
        (chunk.sampled >> slot & 1 == 1).then(|| chunk.digests[slot])
    }

    /// The digest the sample index counts for the known page at `addr`, if any.
    pub fn counted_digest(&self, addr: u64) -> Option<u32> {
        let (key, slot) = split(addr);
        let chunk = self.chunks.get(&key)?;
        (chunk.tracked >> slot & 1 == 1).then(|| chunk.digests[slot])
    }

    /// Stops keeping as sampled the pages whose digest `wanted` says, without a change for
    /// the sample index (the caller takes them out of it); returns them with their digests.
    pub fn take_sampled_where(&mut self, wanted: impl Fn(u32) -> bool) -> Vec<(u64, u32)> {
        let mut taken = Vec::new();
        let mut emptied = Vec::new();
        for (&key, chunk) in self.chunks.iter_mut() {
            let mut sampled = chunk.sampled;
            while sampled != 0 {
                let slot = sampled.trailing_zeros() as usize;
                sampled &= sampled - 1;
                if wanted(chunk.digests[slot]) {
                    chunk.sampled &= !(1 << slot);
                    self.sampled -= 1;
                    taken.push((
                        key * CHUNK_SPAN + slot as u64 * PAGE_SIZE,
                        chunk.digests[slot],
                    ));
                }
            }
            if chunk.is_empty() {
                emptied.push(key);
            }
        }
        for key in emptied {
            self.chunks.remove(&key);
        }
        taken
    }

    /// Forgets the pages only sampled in `start..end` (queued for the sample index).
    pub fn forget_sampled_in(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let keys: Vec<u64> = self
            .chunks
            .range(start / CHUNK_SPAN..=(end - 1) / CHUNK_SPAN)
            .filter(|(_, c)| c.sampled != 0)
            .map(|(&k, _)| k)
            .collect();
        for key in keys {
            let Some(chunk) = self.chunks.get_mut(&key) else {
                continue;
            };
            let mut sampled = chunk.sampled;
            while sampled != 0 {
                let slot = sampled.trailing_zeros() as usize;
                sampled &= sampled - 1;
                let addr = key * CHUNK_SPAN + slot as u64 * PAGE_SIZE;
                if (start..end).contains(&addr) {
                    release(chunk, slot, addr, &mut self.changes, &mut self.sampled);
                }
            }
            if chunk.is_empty() {
                self.chunks.remove(&key);
            }
        }
    }

    /// Pages only sampled.
    pub fn sampled_len(&self) -> u64 {
        self.sampled
    }

    /// What the sample index must follow since the last take.
    pub fn take_changes(&mut self) -> Vec<DigestChange> {
        std::mem::take(&mut self.changes)
    }

    /// Hands what the sample index must follow since the last take to `follow`, and
    /// forgets it; the queue keeps its room, which a first pass refills batch after batch.
    pub fn settle_changes(&mut self, follow: impl FnOnce(&[DigestChange])) {
        if !self.changes.is_empty() {
            follow(&self.changes);
            self.changes.clear();
        }
    }

    /// Holds the known page at `addr` for the gate, with the checksum it has here.
    pub fn hold(&mut self, addr: u64) {
        let (key, slot) = split(addr);
        let Some(chunk) = self.chunks.get_mut(&key) else {
            debug_assert!(false, "only a known page is held");
            return;
        };
        let bit = 1u64 << slot;
        debug_assert!(chunk.known & bit != 0, "only a known page is held");
        if chunk.held == 0 {
            self.held_chunks.push(key);
        }
        chunk.held |= bit & chunk.known;
    }

    /// The pages held since the last take, with their checksums, in address order; each is
    /// held no longer once given (those not given, if it is dropped early, stay held). A
    /// page forgotten meanwhile is not among them.
    pub fn take_held(&mut self) -> TakenHeld<'_> {
        let mut keys = std::mem::take(&mut self.held_chunks);
        keys.sort_unstable();
        keys.dedup();
        TakenHeld {
            keys: keys.into_iter(),
            key: 0,
            bits: 0,
            state: self,
        }
    }

    /// Forgets the page at `addr`; returns what was known.
    pub fn remove(&mut self, addr: u64) -> Option<PageInfo> {
        let (key, slot) = split(addr);
        let chunk = self.chunks.get_mut(&key)?;
        let bit = 1u64 << slot;
        if chunk.known & bit == 0 {
            return None;
        }
        let info = PageInfo {
            checksum: chunk.checksum(slot),
            placed: chunk.placed & bit != 0,
        };
        let had_pending = chunk.pending() != 0;
        release(chunk, slot, addr, &mut self.changes, &mut self.sampled);
        chunk.known &= !bit;
        chunk.placed &= !bit;
        chunk.held &= !bit;
        if chunk.known == 0 {
            chunk.checksums = None;
        }
        list_pending(
            &mut self.pending_chunks,
            key,
            had_pending,
            chunk.pending() != 0,
        );
        if chunk.is_empty() {
            self.chunks.remove(&key);
        }
        self.len -= 1;
        Some(info)
    }

    /// The known pages in `start..end`, in address order.
    pub fn pages_in(&self, start: u64, end: u64) -> Vec<(u64, PageInfo)> {
        let mut out = Vec::new();
        if start >= end {
            return out;
        }
        for (&key, chunk) in self
            .chunks
            .range(start / CHUNK_SPAN..=(end - 1) / CHUNK_SPAN)
        {
            let mut known = chunk.known;
            while known != 0 {
                let slot = known.trailing_zeros() as u64;
                known &= known - 1;
                let addr = key * CHUNK_SPAN + slot * PAGE_SIZE;
                if (start..end).contains(&addr) {
                    out.push((
                        addr,
                        PageInfo {
                            checksum: chunk.checksum(slot as usize),
                            placed: chunk.placed >> slot & 1 == 1,
                        },
                    ));
                }
            }
        }
        out
    }

    /// Pages hashed once and waiting for the gate, in `start..end`.
    pub fn pending_in(&self, start: u64, end: u64) -> impl Iterator<Item = u64> + '_ {
        let keys = if start < end {
            self.pending_chunks
                .range(start / CHUNK_SPAN..=(end - 1) / CHUNK_SPAN)
        } else {
            self.pending_chunks.range(0..0)
        };
        keys.flat_map(move |&key| {
            let mut pending = self.chunks.get(&key).map_or(0, |c| c.pending());
            std::iter::from_fn(move || {
                (pending != 0).then(|| {
                    let slot = pending.trailing_zeros() as u64;
                    pending &= pending - 1;
                    key * CHUNK_SPAN + slot * PAGE_SIZE
                })
            })
        })
        .filter(move |addr| (start..end).contains(addr))
    }

    /// Forgets every page outside `vmas` and returns them (the caller takes placed ones out
    /// of the index).
    pub fn keep_within(&mut self, vmas: &[Vma]) -> Vec<(u64, PageInfo)> {
        self.scanned = self.scanned.clip_to(vmas.iter().map(Vma::range));
        let mut inside = RangeSet::default();
        for vma in vmas {
            inside.insert(vma.range());
        }
        let mut gone = Vec::new();
        let mut from = 0;
        for range in inside
            .as_slice()
            .iter()
            .copied()
            .chain([Range::new(u64::MAX, u64::MAX)])
        {
            if from < range.start && self.chunks.range(from / CHUNK_SPAN..).next().is_some() {
                gone.extend(self.pages_in(from, range.start));
            }
            from = range.end;
        }
        for &(addr, _) in &gone {
            self.remove(addr);
        }
        let mut from = 0;
        for range in inside.as_slice().iter().copied() {
            self.forget_sampled_in(from, range.start);
            from = range.end;
        }
        self.forget_sampled_in(from, u64::MAX);
        gone
    }

    /// Forgets everything (a scan that failed half-way); returns what was known.
    pub fn clear(&mut self) -> Vec<(u64, PageInfo)> {
        let all = self.pages_in(0, u64::MAX);
        for &(addr, _) in &all {
            self.remove(addr);
        }
        self.forget_sampled_in(0, u64::MAX);
        let changes = self.take_changes();
        *self = PageState::default();
        self.changes = changes;
        all
    }

    /// Bytes of heap this state holds (chunks, pending chunks, scanned ranges), approximately.
    pub fn heap_bytes(&self) -> u64 {
        // A B-tree entry costs about twice its key and value.
        let chunks = self.chunks.len() as u64 * (size_of::<Chunk>() as u64 + 32)
            + self
                .chunks
                .values()
                .filter(|c| c.checksums.is_some())
                .count() as u64
                * (size_of::<[u64; CHUNK_PAGES as usize]>() as u64 + 16);
        chunks
            + self.pending_chunks.len() as u64 * 16
            + self.held_chunks.capacity() as u64 * 8
            + self.scanned.as_slice().len() as u64 * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE_SIZE;

    #[test]
    fn pages_are_set_read_and_forgotten() {
        let mut state = PageState::default();
        state.set(
            5 * P,
            PageInfo {
                checksum: 7,
                placed: false,
            },
        );
        state.set(
            70 * P,
            PageInfo {
                checksum: 9,
                placed: true,
            },
        );
        assert_eq!(state.len(), 2);
        assert_eq!(state.pending_in(0, u64::MAX).collect::<Vec<_>>(), [5 * P]);
        assert_eq!(
            state.get(70 * P),
            Some(PageInfo {
                checksum: 9,
                placed: true
            })
        );
        assert_eq!(state.get(6 * P), None);
        assert_eq!(
            state
                .pages_in(0, 71 * P)
                .iter()
                .map(|p| p.0)
                .collect::<Vec<_>>(),
            [5 * P, 70 * P]
        );
        // Placing a pending page takes it off the pending list.
        state.set(
            5 * P,
            PageInfo {
                checksum: 7,
                placed: true,
            },
        );
        assert_eq!(state.pending_in(0, u64::MAX).count(), 0);
        assert!(state.remove(5 * P).is_some_and(|p| p.placed));
        assert_eq!(state.len(), 1);
        assert_eq!(state.chunks.len(), 1, "an empty chunk is freed");
    }

    fn placed(state: &mut PageState, addr: u64, checksum: u64) {
        state.set(
            addr,
            PageInfo {
                checksum,
                placed: true,
            },
        );
    }

    #[test]
    fn held_pages_are_taken_once_in_address_order_with_their_checksums() {
        let mut state = PageState::default();
        for (addr, sum) in [(200 * P, 2), (3 * P, 1), (64 * P, 3), (5 * P, 4)] {
            placed(&mut state, addr, sum);
            state.hold(addr);
        }
        placed(&mut state, 6 * P, 5);
        // Forgotten after it was held: not taken.
        state.remove(64 * P);
        assert_eq!(
            state.take_held().collect::<Vec<_>>(),
            [(3 * P, 1), (5 * P, 4), (200 * P, 2)]
        );
        assert_eq!(state.take_held().count(), 0, "taken once");
        // Held again after a take: taken at the next, even in a chunk held before.
        state.hold(5 * P);
        placed(&mut state, 64 * P, 6);
        state.hold(64 * P);
        assert_eq!(
            state.take_held().collect::<Vec<_>>(),
            [(5 * P, 4), (64 * P, 6)]
        );
    }

    #[test]
    fn a_batch_recorded_at_once_is_what_its_pages_set_one_by_one_are() {
        // Pages across three chunks, some only sampled before, some known, some held.
        let pages = [
            (2, None, false),
            (3, Some(9), true),
            (63, Some(8), false),
            (64, None, true),
            (65, Some(9), true),
            (300, Some(7), false),
        ];
        let (mut one_by_one, mut at_once) = (PageState::default(), PageState::default());
        for state in [&mut one_by_one, &mut at_once] {
            state.set_sampled(&[3 * P, 64 * P], &[9, 6]);
            placed(state, 63 * P, 1);
            state.hold(63 * P);
            state.take_changes();
        }
        let info = |page: u64| PageInfo {
            checksum: page * 10,
            placed: page.is_multiple_of(2),
        };
        let records: Vec<Record> = pages
            .iter()
            .map(|&(page, digest, held)| Record {
                addr: page * P,
                info: info(page),
                digest,
                held,
            })
            .collect();
        for r in &records {
            one_by_one.set_with_digest(r.addr, r.info, r.digest);
            if r.held {
                one_by_one.hold(r.addr);
            }
        }
        at_once.record_all(&records);
        for state in [&mut one_by_one, &mut at_once] {
            assert_eq!(state.len(), 6);
            assert_eq!(state.sampled_len(), 0, "both pages only sampled were read");
            assert_eq!(
                state.pending_in(0, u64::MAX).count(),
                3,
                "the odd pages are not placed"
            );
        }
        assert_eq!(one_by_one.take_changes(), at_once.take_changes());
        let asked = [1, 2, 3, 63, 64, 66, 300, 301].map(|page| page * P);
        assert_eq!(
            at_once.known_at(asked),
            asked
                .iter()
                .filter_map(|&a| Some((a, at_once.get(a)?)))
                .collect::<Vec<_>>(),
            "each known page asked for, in order"
        );
        for &(page, _, _) in &pages {
            assert_eq!(at_once.get(page * P), Some(info(page)), "page {page}");
            assert_eq!(
                at_once.counted_digest(page * P),
                one_by_one.counted_digest(page * P)
            );
        }
        assert_eq!(
            at_once.take_held().collect::<Vec<_>>(),
            one_by_one.take_held().collect::<Vec<_>>()
        );
    }

    #[test]
    fn held_pages_not_given_stay_held() {
        let mut state = PageState::default();
        for page in [1, 2, 70, 140] {
            placed(&mut state, page * P, page);
            state.hold(page * P);
        }
        assert_eq!(state.take_held().next(), Some((P, 1)));
        assert_eq!(
            state.take_held().collect::<Vec<_>>(),
            [(2 * P, 2), (70 * P, 70), (140 * P, 140)]
        );
        state.hold(2 * P);
        state.clear();
        assert_eq!(state.take_held().count(), 0, "cleared with the rest");
    }

    #[test]
    fn pending_pages_are_the_known_unplaced_ones_in_any_range() {
        // Random sets, placements and removals over five chunks, against a plain model.
        let mut state = PageState::default();
        let mut model = std::collections::BTreeMap::<u64, bool>::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..5_000 {
            let addr = (next(5 * CHUNK_PAGES) + 3) * P;
            match next(3) {
                0 => {
                    state.remove(addr);
                    model.remove(&addr);
                }
                op => {
                    let placed = op == 1;
                    state.set(
                        addr,
                        PageInfo {
                            checksum: addr,
                            placed,
                        },
                    );
                    model.insert(addr, placed);
                }
            }
            let (start, end) = (next(6 * CHUNK_PAGES) * P, next(6 * CHUNK_PAGES) * P);
            let expected: Vec<u64> = model
                .iter()
                .filter(|&(&a, &placed)| !placed && (start..end).contains(&a))
                .map(|(&a, _)| a)
                .collect();
            assert_eq!(state.pending_in(start, end).collect::<Vec<_>>(), expected);
        }
        assert_eq!(state.len(), model.len() as u64);
        // No chunk is listed as pending without a pending page, nor left out with one.
        for (key, chunk) in &state.chunks {
            assert_eq!(state.pending_chunks.contains(key), chunk.pending() != 0);
        }
        assert!(state
            .pending_chunks
            .iter()
            .all(|k| state.chunks.contains_key(k)));
    }

    #[test]
    fn pages_outside_the_vmas_are_forgotten() {
        let mut state = PageState::default();
        for page in [1, 10, 100, 1000] {
            state.set(
                page * P,
                PageInfo {
                    checksum: page,
                    placed: true,
                },
            );
        }
        let gone =
            state.keep_within(&[Vma::anonymous(0, 50 * P), Vma::anonymous(900 * P, 2000 * P)]);
        assert_eq!(gone.iter().map(|p| p.0).collect::<Vec<_>>(), [100 * P]);
        assert_eq!(state.len(), 3);
    }

    #[test]
    fn a_sparse_terabyte_costs_what_its_present_pages_cost() {
        let mut state = PageState::default();
        // 16 pages touched, 64 GiB apart, in a 1 TiB mapping.
        for i in 0..16u64 {
            state.set(
                i * (64 << 30),
                PageInfo {
                    checksum: i,
                    placed: true,
                },
            );
        }
        assert!(
            state.heap_bytes() < 16 * 1024,
            "{} bytes",
            state.heap_bytes()
        );
        // Dense memory: about 12.5 bytes a page (a checksum and a digest).
        let mut dense = PageState::default();
        for i in 0..65_536u64 {
            dense.set(
                i * P,
                PageInfo {
                    checksum: i,
                    placed: true,
                },
            );
        }
        assert!(dense.heap_bytes() / 65_536 <= 13);
    }

    #[test]
    fn every_page_that_leaves_tells_the_sample_index_what_it_counted() {
        use DigestChange::*;
        let mut state = PageState::default();
        state.set_sampled(&[0, P, 70 * P], &[1, 2, 3]);
        assert_eq!((state.sampled_len(), state.len()), (3, 0));
        assert_eq!(state.sampled_digest(P), Some(2));
        assert!(state.take_changes().is_empty(), "the caller counted them");
        // Read whole: the page only sampled becomes a counted one.
        let info = PageInfo {
            checksum: 9,
            placed: true,
        };
        state.set_with_digest(P, info, Some(4));
        assert_eq!(state.take_changes(), [Unsampled(P, 2), Counted(4)]);
        assert_eq!(
            (state.sampled_digest(P), state.counted_digest(P)),
            (None, Some(4))
        );
        // Rewritten without a digest, then gone.
        state.set(P, info);
        assert_eq!(state.take_changes(), [Uncounted(4)]);
        state.set_with_digest(2 * P, info, Some(5));
        state.remove(2 * P);
        assert_eq!(state.take_changes(), [Counted(5), Uncounted(5)]);
        // Taken out to be read whole: no change, the caller takes them out of the index.
        assert_eq!(state.take_sampled_where(|d| d == 3), [(70 * P, 3)]);
        assert!(state.take_changes().is_empty());
        // Outside the VMAs, or everything: queued.
        state.set_sampled(&[200 * P], &[6]);
        state.keep_within(&[Vma::anonymous(0, 100 * P)]);
        assert_eq!(state.take_changes(), [Unsampled(200 * P, 6)]);
        state.set_with_digest(3 * P, info, Some(7));
        state.take_changes();
        state.clear();
        assert_eq!(state.take_changes(), [Uncounted(7), Unsampled(0, 1)]);
        assert_eq!(state.sampled_len(), 0);
    }
}
