//! Hash tables of small entries, for the tables rksm keeps an entry in for most pages it
//! holds: the counts of the digests that more than one page has, and the index's classes
//! (the digests of pages only sampled are kept tighter still, in `engine::digests`).
//!
//! rksm's memory grows with the memory it watches, and these tables are much of it. The
//! standard table spends a control byte per bucket besides the entry, and its bucket count
//! is a power of two, so one entry past a power of two doubles it. Here a bucket is the entry
//! alone (0 marks an empty one), buckets grow by half, and entries are found by linear
//! probing, which keeps a lookup within a cache line or two at the load allowed. An entry is
//! a `u32` or `u64` the caller gives meaning to: a digest itself (four bytes), a key with its
//! value (eight), or the slot of a record that holds the key with the high half of the key's
//! hash (eight bytes: an entry of another key is then passed over without reading its
//! record, a trip to memory). The caller says how to hash an entry and whether one is the key
//! sought.

use crate::engine::keys::KeyHasher;
use std::hash::Hasher;

/// The most entries per bucket before the table grows: at this load an absent key is found
/// absent after about 13 buckets, a present one after 3.
const MAX_LOAD: (usize, usize) = (4, 5);

/// The load under which [`Table::shrink`] gives room back, and the load it leaves.
const SHRINK_BELOW: (usize, usize) = (7, 10);
const SHRUNK_TO: (usize, usize) = (3, 4);

/// Spreads `key` over 64 bits, as the engine's other tables do.
pub fn mix(key: u64) -> u64 {
    let mut h = KeyHasher::default();
    h.write_u64(key);
    h.finish()
}

/// A hint to fetch the cache line at `p`; it reads nothing and cannot fault.
#[inline(always)]
pub(super) fn prefetch(p: *const i8) {
    // SAFETY: SSE, which the prefetch instruction needs, is part of every x86_64 CPU; a
    // prefetch does not dereference its address, so any value of `p` is sound.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// What a bucket holds: an entry, or 0 for none.
pub trait Entry: Copy + Eq + std::fmt::Debug {
    /// The empty bucket.
    const NONE: Self;
}

impl Entry for u32 {
    const NONE: u32 = 0;
}

impl Entry for u64 {
    const NONE: u64 = 0;
}

/// Nonzero entries, found by a hash the caller computes.
#[derive(Debug, Clone)]
pub struct Table<E> {
    buckets: Vec<E>,
    len: usize,
    /// The buckets were last made more by [`Table::reserve`], not by growing: room
    /// [`Table::shrink`] may give back.
    reserved: bool,
}

impl<E> Default for Table<E> {
    fn default() -> Self {
        Table {
            buckets: Vec::new(),
            len: 0,
            reserved: false,
        }
    }
}

impl<E: Entry> Table<E> {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bucket a hash starts from: the hash's high bits scaled to the bucket count, so
    /// that any count works.
    fn home(&self, hash: u64) -> usize {
        (((hash >> 32) * self.buckets.len() as u64) >> 32) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.buckets.len() {
            0
        } else {
            i + 1
        }
    }

    /// The bucket holding the entry `is` accepts, or the empty bucket where it would go.
    fn probe(&self, hash: u64, is: impl Fn(E) -> bool) -> Result<usize, usize> {
        let mut i = self.home(hash);
        loop {
            match self.buckets[i] {
                e if e == E::NONE => return Err(i),
                entry if is(entry) => return Ok(i),
                _ => i = self.next(i),
            }
        }
    }

    /// Asks the CPU to fetch the bucket a lookup of `hash` starts from, so that a lookup
    /// issued a little later finds it in the cache: a table of millions of entries is
    /// mostly not, and lookups of unrelated keys, one after another, would each wait for
    /// memory in turn.
    pub fn prefetch(&self, hash: u64) {
        if let Some(bucket) = self.buckets.get(self.home(hash)) {
            prefetch(std::ptr::from_ref(bucket).cast());
        }
    }

    /// The entry with hash `hash` that `is` accepts.
    pub fn get(&self, hash: u64, is: impl Fn(E) -> bool) -> Option<E> {
        if self.buckets.is_empty() {
            return None;
        }
        self.probe(hash, is).ok().map(|i| self.buckets[i])
    }

    /// The entries with hash `hash` that `is` accepts (a table may hold several that it
    /// accepts: the caller decides what is one key).
    pub fn matching<'a>(
        &'a self,
        hash: u64,
        is: impl Fn(E) -> bool + 'a,
    ) -> impl Iterator<Item = E> + 'a {
        let start = (!self.buckets.is_empty()).then(|| self.home(hash));
        std::iter::successors(start, move |&i| Some(self.next(i)))
            .map(move |i| self.buckets[i])
            .take_while(|&e| e != E::NONE)
            .filter(move |&e| is(e))
    }

    /// Adds `entry` (nonzero), whose hash is `hash`, unless one `is` accepts is held; true if
    /// added. `hash_of` hashes any entry held, to move it when the table grows.
    pub fn insert(
        &mut self,
        hash: u64,
        entry: E,
        is: impl Fn(E) -> bool,
        hash_of: impl Fn(E) -> u64,
    ) -> bool {
        debug_assert_ne!(entry, E::NONE);
        if self.full() {
            self.grow(&hash_of);
        }
        match self.probe(hash, is) {
            Ok(_) => false,
            Err(i) => {
                self.buckets[i] = entry;
                self.len += 1;
                true
            }
        }
    }

    /// Puts `entry` (nonzero) in place of the one `is` accepts, or adds it as
    /// [`Table::insert`] does: one probe, unless the table must grow first.
    pub fn put(&mut self, hash: u64, entry: E, is: impl Fn(E) -> bool, hash_of: impl Fn(E) -> u64) {
        debug_assert_ne!(entry, E::NONE);
        if !self.buckets.is_empty() {
            match self.probe(hash, &is) {
                Ok(i) => {
                    self.buckets[i] = entry;
                    return;
                }
                Err(i) if !self.full() => {
                    self.buckets[i] = entry;
                    self.len += 1;
                    return;
                }
                Err(_) => {}
            }
        }
        self.insert(hash, entry, is, hash_of);
    }

    /// Takes out the entry with hash `hash` that `is` accepts, if held. The entries after it
    /// move back into the gap where their own probe allows it, so that no marker of a removed
    /// entry is left to lengthen later probes.
    pub fn remove(
        &mut self,
        hash: u64,
        is: impl Fn(E) -> bool,
        hash_of: impl Fn(E) -> u64,
    ) -> Option<E> {
        if self.buckets.is_empty() {
            return None;
        }
        let found = self.probe(hash, is).ok()?;
        let entry = self.buckets[found];
        let cap = self.buckets.len();
        let distance = |from: usize, to: usize| (to + cap - from) % cap;
        let mut gap = found;
        let mut i = self.next(found);
        while self.buckets[i] != E::NONE {
            let home = self.home(hash_of(self.buckets[i]));
            // The entry at i may fill the gap if the gap lies on its probe, from home to i.
            if distance(home, i) >= distance(gap, i) {
                self.buckets[gap] = self.buckets[i];
                gap = i;
            }
            i = self.next(i);
        }
        self.buckets[gap] = E::NONE;
        self.len -= 1;
        Some(entry)
    }

    /// Every entry held, in no order.
    pub fn iter(&self) -> impl Iterator<Item = E> + '_ {
        self.buckets.iter().copied().filter(|&e| e != E::NONE)
    }

    /// Makes room for `additional` more entries at once, where the caller knows how many
    /// are coming: growing by half at a time would move every entry several times over.
    pub fn reserve(&mut self, additional: usize, hash_of: impl Fn(E) -> u64) {
        let wanted = (self.len + additional) * MAX_LOAD.1 / MAX_LOAD.0 + 1;
        if additional > 0 && wanted > self.buckets.len() {
            self.rebuild(wanted, &hash_of);
            self.reserved = true;
        }
    }

    /// Gives back room made at once ([`Table::reserve`]) for entries many of which left:
    /// a table so enlarged and now below [`SHRINK_BELOW`] of its buckets is rebuilt at
    /// [`SHRUNK_TO`]. Room the table made by growing is kept: growing leaves it at two
    /// thirds of the most it allows, and giving that back would have it rebuilt again with
    /// every few percent it grew.
    pub fn shrink(&mut self, hash_of: impl Fn(E) -> u64) {
        if std::mem::take(&mut self.reserved)
            && self.len * SHRINK_BELOW.1 < self.buckets.len() * SHRINK_BELOW.0
        {
            self.rebuild_smaller(&hash_of);
        }
    }

    /// Gives back room, however it was made, once three quarters of the buckets are empty:
    /// for a table that grows by inserts and loses entries as it goes. Growing leaves half
    /// of them empty, so a table is not rebuilt smaller only to grow again soon after.
    pub fn compact(&mut self, hash_of: impl Fn(E) -> u64) {
        if self.len * 4 < self.buckets.len() {
            self.rebuild_smaller(&hash_of);
            self.reserved = false;
        }
    }

    /// Rebuilds the table at [`SHRUNK_TO`] of its entries in the buckets it has, and hands
    /// the rest back: no new table to clear and fill while the old one is still held.
    ///
    /// An entry's home is its hash's high bits scaled to the bucket count, so homes keep
    /// their order whatever the count. Past the run at the start (which may hold entries that
    /// wrapped around the end: they are set aside), every entry lies at or after its home,
    /// and a run of entries sorted by hash lies so too; so taken run by run, sorted, and each
    /// put at its home in the smaller table or just after the entry put before it, the
    /// entries only ever move towards the start, onto buckets already emptied, and each is
    /// found from its home without an empty bucket on the way. What would land past the end
    /// joins those set aside, which are then put in as any entry is.
    fn rebuild_smaller(&mut self, hash_of: &impl Fn(E) -> u64) {
        let cap = (self.len * SHRUNK_TO.1 / SHRUNK_TO.0 + 1).max(16);
        let old = self.buckets.len();
        if cap >= old {
            return;
        }
        let key = |e: E| hash_of(e) >> 32;
        let home = |key: u64| ((key * cap as u64) >> 32) as usize;
        let mut aside = Vec::new();
        let mut i = 0;
        while i < old && self.buckets[i] != E::NONE {
            aside.push(std::mem::replace(&mut self.buckets[i], E::NONE));
            i += 1;
        }
        let mut run: Vec<(u64, E)> = Vec::new();
        let mut free = 0;
        while i < old {
            if self.buckets[i] == E::NONE {
                i += 1;
                continue;
            }
            run.clear();
            while i < old && self.buckets[i] != E::NONE {
                let entry = std::mem::replace(&mut self.buckets[i], E::NONE);
                run.push((key(entry), entry));
                i += 1;
            }
            run.sort_unstable_by_key(|&(key, _)| key);
            for &(key, entry) in &run {
                let at = home(key).max(free);
                if at < cap {
                    self.buckets[at] = entry;
                    free = at + 1;
                } else {
                    aside.push(entry);
                }
            }
        }
        self.buckets.truncate(cap);
        self.buckets.shrink_to_fit();
        for entry in aside {
            if let Err(at) = self.probe(hash_of(entry), |_| false) {
                self.buckets[at] = entry;
            }
        }
    }

    /// Whether one more entry would take the table past its load.
    fn full(&self) -> bool {
        (self.len + 1) * MAX_LOAD.1 > self.buckets.len() * MAX_LOAD.0
    }

    fn grow(&mut self, hash_of: &impl Fn(E) -> u64) {
        let cap = (self.buckets.len() + self.buckets.len() / 2).max(16);
        self.rebuild(cap, hash_of);
        self.reserved = false;
    }

    fn rebuild(&mut self, cap: usize, hash_of: &impl Fn(E) -> u64) {
        let old = std::mem::replace(&mut self.buckets, vec![E::NONE; cap]);
        for entry in old.into_iter().filter(|&e| e != E::NONE) {
            if let Err(i) = self.probe(hash_of(entry), |_| false) {
                self.buckets[i] = entry;
            }
        }
    }
}

fn hash_digest(digest: u32) -> u64 {
    mix(u64::from(digest))
}

/// A map of `u32` keys to nonzero `u32` values, the key and its value in one `u64` bucket.
/// Unlike the standard map's, a lookup can be fetched ahead ([`CountMap::prefetch`]).
#[derive(Debug, Default, Clone)]
pub struct CountMap {
    table: Table<u64>,
}

fn pack(key: u32, value: u32) -> u64 {
    (u64::from(key) << 32) | u64::from(value)
}

fn key_of(entry: u64) -> u32 {
    (entry >> 32) as u32
}

fn value_of(entry: u64) -> u32 {
    entry as u32
}

fn hash_entry(entry: u64) -> u64 {
    hash_digest(key_of(entry))
}

impl CountMap {
    /// The value of `key`, if it has one.
    pub fn get(&self, key: u32) -> Option<u32> {
        self.table
            .get(hash_digest(key), |e| key_of(e) == key)
            .map(value_of)
    }

    /// Sets the value of `key` to `value`, which is not 0 (a key without a value is
    /// [`CountMap::remove`]d).
    pub fn set(&mut self, key: u32, value: u32) {
        debug_assert_ne!(value, 0, "a value of 0 for {key}");
        self.table.put(
            hash_digest(key),
            pack(key, value),
            |e| key_of(e) == key,
            hash_entry,
        );
    }

    /// Takes `key` out, with its value if it had one.
    pub fn remove(&mut self, key: u32) -> Option<u32> {
        self.table
            .remove(hash_digest(key), |e| key_of(e) == key, hash_entry)
            .map(value_of)
    }

    /// Fetches where `key` would be, ahead of a lookup of it.
    pub fn prefetch(&self, key: u32) {
        self.table.prefetch(hash_digest(key));
    }

    /// Gives back room once three quarters of it are empty (see [`Table::compact`]).
    pub fn compact(&mut self) {
        self.table.compact(hash_entry);
    }

    /// Keys with a value.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no key has a value.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// A small deterministic generator: the tests need many values, not good ones.
    fn values(seed: u64, n: usize, range: u32) -> Vec<u32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as u32) % range
            })
            .collect()
    }

    #[test]
    fn a_count_map_agrees_with_the_standard_map_and_gives_room_back_once_mostly_empty() {
        for range in [50, 5_000, u32::MAX] {
            let mut mine = CountMap::default();
            let mut theirs = std::collections::HashMap::new();
            let ops = values(range as u64 + 1, 40_000, range);
            for (i, &k) in ops.iter().enumerate() {
                match i % 4 {
                    3 => assert_eq!(mine.remove(k), theirs.remove(&k), "remove {k}"),
                    // Zero is a key like any other; values are not 0.
                    _ => {
                        let v = (i as u32 % 7) + 1;
                        mine.set(k, v);
                        theirs.insert(k, v);
                    }
                }
                assert_eq!(mine.len(), theirs.len());
            }
            for k in values(9, 2_000, range).into_iter().chain([0]) {
                assert_eq!(mine.get(k), theirs.get(&k).copied(), "get {k}");
            }
        }
        let mut map = CountMap::default();
        let mut keys = values(11, 100_000, u32::MAX);
        keys.sort_unstable();
        keys.dedup();
        for &k in &keys {
            map.set(k, k | 1);
        }
        let grown = map.table.buckets.len();
        map.compact();
        assert_eq!(map.table.buckets.len(), grown, "a table just grown is kept");
        let (stay, go) = keys.split_at(10_000);
        for &k in go {
            map.remove(k);
        }
        map.compact();
        let after = map.table.buckets.len();
        assert!(after * 4 < grown, "{grown} buckets, then {after}");
        assert!(stay.iter().all(|&k| map.get(k) == Some(k | 1)));
        assert!(go.iter().all(|&k| map.get(k).is_none()));
    }

    #[test]
    fn a_table_rebuilt_smaller_in_place_keeps_every_entry_findable() {
        // Hashes spread at random, and, for one entry in 32, hashes crowded at the very end
        // of the table: their run wraps around to its start, and, rebuilt smaller, would
        // land past its end.
        let crowded = |e: u64| e & 0x1f == 1;
        let hash_of = |e: u64| match crowded(e) {
            true => (u64::MAX - (e & 0xffff) * 0x1_0000_0000) ^ (e >> 16),
            false => mix(e),
        };
        for seed in 1..4 {
            let mut table = Table::<u64>::default();
            let all: Vec<u64> = values(seed, 20_000, u32::MAX)
                .into_iter()
                .enumerate()
                .map(|(i, v)| ((u64::from(v) << 16) | (i as u64 & 0xffff)) | 1)
                .collect();
            table.reserve(all.len(), hash_of);
            for &e in &all {
                table.insert(hash_of(e), e, |x| x == e, hash_of);
            }
            let last = table.buckets.len() - 1;
            assert!(
                crowded(table.buckets[0]) && crowded(table.buckets[last]),
                "the crowded run wraps around"
            );
            let (stay, go) = all.split_at(all.len() / 4);
            for &e in go {
                table.remove(hash_of(e), |x| x == e, hash_of);
            }
            let before = table.buckets.len();
            table.shrink(hash_of);
            assert!(table.buckets.len() < before / 2, "not rebuilt smaller");
            let stay: HashSet<u64> = stay.iter().copied().collect();
            assert_eq!(table.len(), stay.len());
            assert_eq!(table.iter().collect::<HashSet<_>>(), stay);
            for &e in &stay {
                assert_eq!(table.get(hash_of(e), |x| x == e), Some(e), "{e:#x} lost");
            }
            for &e in go {
                assert_eq!(table.get(hash_of(e), |x| x == e), None, "{e:#x} kept");
            }
        }
    }

    #[test]
    fn a_table_grows_by_half_and_stays_below_its_load() {
        let hash_of = |e: u32| mix(u64::from(e));
        let mut table = Table::<u32>::default();
        for d in 1..=100_000 {
            table.insert(hash_of(d), d, |e| e == d, hash_of);
        }
        let buckets = table.buckets.len();
        assert!(
            buckets * 4 >= 100_000 * 5 && buckets <= 100_000 * 5 / 4 * 3 / 2 + 16,
            "{buckets} buckets for 100,000 digests"
        );
    }

    #[test]
    fn entries_that_stand_for_records_are_found_through_them() {
        // Entries are slots (plus one) in a vector of keys.
        let keys = [10u64, 20, 30, 40];
        let hash_of = |e: u32| mix(keys[e as usize - 1]);
        let mut table = Table::<u32>::default();
        for (i, &k) in keys.iter().enumerate() {
            let slot = i as u32 + 1;
            assert!(table.insert(mix(k), slot, |e| keys[e as usize - 1] == k, hash_of));
        }
        assert_eq!(table.get(mix(30), |e| keys[e as usize - 1] == 30), Some(3));
        assert_eq!(
            table.remove(mix(20), |e| keys[e as usize - 1] == 20, hash_of),
            Some(2)
        );
        assert_eq!(table.get(mix(20), |e| keys[e as usize - 1] == 20), None);
        assert_eq!(table.iter().count(), 3);
    }
}
