//! The set of digests of the pages only sampled (see `ebpf::sampler`): one entry for most of
//! the pages rksm watches, so its size per entry is much of rksm's memory per page.
//!
//! A digest is a uniform 32-bit value (rksm's own mix of the sampled bytes, mixed again
//! here), so a set of them need not store them whole. The set is a row of blocks of one
//! cache line each; a digest's block is the high bits of its mix scaled to the number of
//! blocks (any number works), and within the block only the mix's low 16 bits are kept: with
//! 65,536 blocks or more, the mixes of one block span fewer than 65,536 values, so their low
//! 16 bits tell them apart and give the whole mix back when the set is rebuilt. That is 31
//! entries to a line, two bytes an entry (a table of whole `u32`s at the same load holds 16
//! and four bytes an entry). A set too small for 65,536 blocks keeps whole mixes, 15 to a
//! line, as such a table would.
//!
//! A lookup reads one line, and the next one where entries of its block went there: a block
//! that is full puts a new entry in the next block's room, counted there as a guest, and one
//! for which the next block is full too goes to a small set of its own, flagged in its
//! block. So a crowd of digests in one block (which pages written to that end could make)
//! costs lookups in that small set, not a larger table.

use std::{collections::HashSet, hash::BuildHasherDefault};

use super::keys::KeyHasher;

/// The most entries per slot before the set grows: a block is then full about one time in
/// twenty, and an entry left for the overflow about one in a thousand.
const MAX_LOAD: (usize, usize) = (3, 4);
/// The load under which [`DigestSet::shrink`] gives room made at once back, and the load it
/// leaves.
const SHRINK_BELOW: (usize, usize) = (2, 3);
const SHRUNK_TO: (usize, usize) = (7, 10);
/// Blocks from which the low 16 bits of a mix tell the mixes of a block apart.
const NARROW_FROM: usize = 1 << 16;

/// A bijection of `u32`s that spreads nearby digests over the blocks and over the low bits.
fn mix(digest: u32) -> u32 {
    let h = digest.wrapping_mul(MIX_A);
    (h ^ (h >> 16)).wrapping_mul(MIX_B)
}

/// The digest whose mix is `h`.
fn unmix(h: u32) -> u32 {
    let h = h.wrapping_mul(inverse(MIX_B));
    (h ^ (h >> 16)).wrapping_mul(inverse(MIX_A))
}

const MIX_A: u32 = 0x9e37_79b1;
const MIX_B: u32 = 0x85eb_ca6b;

/// The inverse of odd `k` modulo 2^32 (Newton's iteration doubles the bits right each step).
const fn inverse(k: u32) -> u32 {
    let mut x = k;
    let mut i = 0;
    while i < 5 {
        x = x.wrapping_mul(2u32.wrapping_sub(k.wrapping_mul(x)));
        i += 1;
    }
    x
}

/// What a block keeps of a mix.
trait Slot: Copy + Eq + std::fmt::Debug {
    /// Slots in a block of one cache line.
    const PER_BLOCK: usize;
    /// The slots of a block.
    type Slots: Copy + AsRef<[Self]> + AsMut<[Self]> + std::fmt::Debug;
    /// What is kept of mix `h`.
    fn of(h: u32) -> Self;
    /// The mix kept as `self` in a block whose mixes start at `start`.
    fn mix(self, start: u32) -> u32;
}

impl Slot for u16 {
    const PER_BLOCK: usize = 31;
    type Slots = [u16; 31];
    fn of(h: u32) -> Self {
        h as u16
    }
    fn mix(self, start: u32) -> u32 {
        // The block's mixes lie in [start, start + 65,536): the one with these low bits.
        start.wrapping_add(u32::from(self.wrapping_sub(start as u16)))
    }
}

impl Slot for u32 {
    const PER_BLOCK: usize = 15;
    type Slots = [u32; 15];
    fn of(h: u32) -> Self {
        h
    }
    fn mix(self, _: u32) -> u32 {
        self
    }
}

/// One cache line: its own entries at the front of `slots`, the guests (entries of the block
/// before it, which was full) at the back.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Block<S: Slot> {
    /// Own entries (the low bits), whether one went to the next block ([`SPILLED`]) and
    /// whether one went to the overflow ([`OVERFLOWED`]): a lookup reads no other line
    /// unless its block says so.
    own: u8,
    guests: u8,
    slots: S::Slots,
}

const OVERFLOWED: u8 = 0x80;
const SPILLED: u8 = 0x40;
const COUNT: u8 = 0x3f;

impl<S: Slot> Block<S> {
    fn own(&self) -> usize {
        usize::from(self.own & COUNT)
    }

    /// Bit `i` set where slot `i` holds `slot`, own and guests alike: every slot compared,
    /// which the compiler does a vector at a time.
    fn matching(&self, slot: S) -> u32 {
        let mut bits = 0;
        for (i, &s) in self.slots.as_ref().iter().enumerate() {
            bits |= u32::from(s == slot) << i;
        }
        bits
    }

    fn own_match(&self, slot: S) -> Option<usize> {
        let own = (1u32 << self.own()) - 1;
        let bits = self.matching(slot) & own;
        (bits != 0).then(|| bits.trailing_zeros() as usize)
    }

    fn guest_match(&self, slot: S) -> Option<usize> {
        let guests = !((1u32 << (S::PER_BLOCK - self.guests())) - 1);
        let bits = self.matching(slot) & guests;
        (bits != 0).then(|| bits.trailing_zeros() as usize)
    }

    fn guests(&self) -> usize {
        usize::from(self.guests)
    }

    fn has_room(&self) -> bool {
        self.own() + self.guests() < S::PER_BLOCK
    }

    fn own_slots(&self) -> &[S] {
        &self.slots.as_ref()[..self.own()]
    }

    fn guest_slots(&self) -> &[S] {
        &self.slots.as_ref()[S::PER_BLOCK - self.guests()..]
    }
}

/// Where an entry is.
enum At {
    Own(usize, usize),
    Guest(usize, usize),
    Overflow,
}

/// `n` blocks of slots `S`.
#[derive(Debug)]
struct Blocks<S: Slot> {
    blocks: Box<[Block<S>]>,
    overflow: HashSet<u32, BuildHasherDefault<KeyHasher>>,
}

impl<S: Slot> Blocks<S> {
    fn new(n: usize) -> Self {
        Blocks {
            blocks: zeroed(n),
            overflow: HashSet::default(),
        }
    }

    fn len(&self) -> usize {
        self.blocks.len()
    }

    /// The block of mix `h`: its high bits scaled to the number of blocks.
    fn home(&self, h: u32) -> usize {
        ((u64::from(h) * self.len() as u64) >> 32) as usize
    }

    fn next(&self, b: usize) -> usize {
        if b + 1 == self.len() {
            0
        } else {
            b + 1
        }
    }

    /// The first mix of block `b`: the least `h` with `home(h) == b`.
    fn start(&self, b: usize) -> u32 {
        ((b as u64) << 32).div_ceil(self.len() as u64) as u32
    }

    fn find(&self, digest: u32, h: u32) -> Option<At> {
        if self.blocks.is_empty() {
            return None;
        }
        let b = self.home(h);
        let slot = S::of(h);
        let home = &self.blocks[b];
        if let Some(i) = home.own_match(slot) {
            return Some(At::Own(b, i));
        }
        if home.own & SPILLED != 0 {
            let n = self.next(b);
            if let Some(i) = self.blocks[n].guest_match(slot) {
                return Some(At::Guest(n, i));
            }
        }
        (home.own & OVERFLOWED != 0 && self.overflow.contains(&digest)).then_some(At::Overflow)
    }

    /// Puts `digest` (mix `h`, not in the set) in.
    fn put(&mut self, digest: u32, h: u32) {
        let b = self.home(h);
        let slot = S::of(h);
        if self.blocks[b].has_room() {
            let block = &mut self.blocks[b];
            let at = block.own();
            block.slots.as_mut()[at] = slot;
            block.own += 1;
            return;
        }
        let n = self.next(b);
        if n != b && self.blocks[n].has_room() {
            let block = &mut self.blocks[n];
            let at = S::PER_BLOCK - 1 - block.guests();
            block.slots.as_mut()[at] = slot;
            block.guests += 1;
            self.blocks[b].own |= SPILLED;
            return;
        }
        self.overflow.insert(digest);
        self.blocks[b].own |= OVERFLOWED;
    }

    fn take(&mut self, at: At, digest: u32) {
        match at {
            At::Own(b, i) => {
                let block = &mut self.blocks[b];
                let last = block.own() - 1;
                block.slots.as_mut().swap(i, last);
                block.own -= 1;
            }
            At::Guest(b, i) => {
                let block = &mut self.blocks[b];
                let first = S::PER_BLOCK - block.guests();
                block.slots.as_mut().swap(i, first);
                block.guests -= 1;
            }
            At::Overflow => {
                self.overflow.remove(&digest);
            }
        }
    }

    /// Every digest held, in no order.
    fn digests(&self) -> impl Iterator<Item = u32> + '_ {
        let blocks = self.blocks.iter().enumerate().flat_map(move |(b, block)| {
            let own_start = self.start(b);
            let before = if b == 0 { self.len() - 1 } else { b - 1 };
            let guest_start = self.start(before);
            let own = block.own_slots().iter().map(move |s| s.mix(own_start));
            let guests = block.guest_slots().iter().map(move |s| s.mix(guest_start));
            own.chain(guests).map(unmix)
        });
        blocks.chain(self.overflow.iter().copied())
    }

    /// Asks the CPU to fetch the block of mix `h`.
    fn prefetch(&self, h: u32) {
        if let Some(block) = self.blocks.get(self.home(h)) {
            super::table::prefetch((block as *const Block<S>).cast());
        }
    }
}

/// `n` blocks of zeros, from memory the kernel gives zeroed: a block's pages are touched
/// only once an entry is put in it, not when the set is made.
fn zeroed<S: Slot>(n: usize) -> Box<[Block<S>]> {
    if n == 0 {
        return Box::new([]);
    }
    let layout = std::alloc::Layout::array::<Block<S>>(n).expect("a set of digests that fits");
    // SAFETY: the layout is not zero-sized (n > 0 blocks of 64 bytes). A block is integers
    // only (repr(C)), so all-zero bytes are a valid block: no entries, no guests.
    let blocks = unsafe {
        let p = std::alloc::alloc_zeroed(layout).cast::<Block<S>>();
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        std::slice::from_raw_parts_mut(p, n)
    };
    // SAFETY: `blocks` was allocated by the global allocator with the layout of `n` blocks,
    // which is what a boxed slice of them frees with, and nothing else holds it.
    unsafe { Box::from_raw(blocks) }
}

/// The blocks, as wide as their number needs.
#[derive(Debug)]
enum Form {
    /// Whole mixes, for fewer than [`NARROW_FROM`] blocks.
    Wide(Blocks<u32>),
    /// Low 16 bits.
    Narrow(Blocks<u16>),
}

/// A set of `u32` digests, in about 2.7 bytes each once it holds more than about 730,000
/// (five under that, as in a hash table of `u32`s); see the module's documentation.
#[derive(Debug)]
pub struct DigestSet {
    form: Form,
    len: usize,
    /// The room was last made more by [`DigestSet::reserve`], not by growing: room
    /// [`DigestSet::shrink`] may give back.
    reserved: bool,
}

impl Default for DigestSet {
    fn default() -> Self {
        DigestSet {
            form: Form::Wide(Blocks::new(0)),
            len: 0,
            reserved: false,
        }
    }
}

/// The form holding `len` digests at `load` (a fraction): the fewest blocks, of the width
/// their number allows.
fn form_for(len: usize, load: (usize, usize)) -> Form {
    let blocks = |per: usize| (len * load.1).div_ceil(per * load.0).max(1);
    match blocks(u32::PER_BLOCK) {
        wide if wide < NARROW_FROM => Form::Wide(Blocks::new(wide)),
        _ => Form::Narrow(Blocks::new(blocks(u16::PER_BLOCK).max(NARROW_FROM))),
    }
}

impl DigestSet {
    fn slots(&self) -> usize {
        match &self.form {
            Form::Wide(b) => b.len() * u32::PER_BLOCK,
            Form::Narrow(b) => b.len() * u16::PER_BLOCK,
        }
    }

    fn find(&self, digest: u32, h: u32) -> Option<At> {
        match &self.form {
            Form::Wide(b) => b.find(digest, h),
            Form::Narrow(b) => b.find(digest, h),
        }
    }

    /// Moves every digest into `form`.
    fn rebuild(&mut self, mut form: Form) {
        fn into<S: Slot>(blocks: &mut Blocks<S>, digests: impl Iterator<Item = u32>) {
            for d in digests {
                blocks.put(d, mix(d));
            }
        }
        match (&self.form, &mut form) {
            (Form::Wide(old), Form::Wide(new)) => into(new, old.digests()),
            (Form::Wide(old), Form::Narrow(new)) => into(new, old.digests()),
            (Form::Narrow(old), Form::Wide(new)) => into(new, old.digests()),
            (Form::Narrow(old), Form::Narrow(new)) => into(new, old.digests()),
        }
        self.form = form;
    }

    /// Adds `digest`; true if it was not in the set.
    pub fn insert(&mut self, digest: u32) -> bool {
        let h = mix(digest);
        if self.find(digest, h).is_some() {
            return false;
        }
        if (self.len + 1) * MAX_LOAD.1 > self.slots() * MAX_LOAD.0 {
            // Grown by half, as the engine's tables grow.
            self.rebuild(form_for((self.len + 1) * 3 / 2, MAX_LOAD));
            self.reserved = false;
        }
        match &mut self.form {
            Form::Wide(b) => b.put(digest, h),
            Form::Narrow(b) => b.put(digest, h),
        }
        self.len += 1;
        true
    }

    /// Takes `digest` out; true if it was in the set.
    pub fn remove(&mut self, digest: u32) -> bool {
        let h = mix(digest);
        let Some(at) = self.find(digest, h) else {
            return false;
        };
        match &mut self.form {
            Form::Wide(b) => b.take(at, digest),
            Form::Narrow(b) => b.take(at, digest),
        }
        self.len -= 1;
        true
    }

    /// Whether `digest` is in the set.
    pub fn contains(&self, digest: u32) -> bool {
        self.find(digest, mix(digest)).is_some()
    }

    /// Makes room for `additional` more digests at once, where the caller knows how many are
    /// coming: growing by half at a time would move every digest several times over.
    pub fn reserve(&mut self, additional: usize) {
        let wanted = self.len + additional;
        if additional > 0 && wanted * MAX_LOAD.1 > self.slots() * MAX_LOAD.0 {
            self.rebuild(form_for(wanted, MAX_LOAD));
            self.reserved = true;
        }
    }

    /// Gives back room made at once ([`DigestSet::reserve`]) for digests many of which left:
    /// a set so enlarged and now below [`SHRINK_BELOW`] of its slots is rebuilt at
    /// [`SHRUNK_TO`]. Room the set made by growing is kept: growing leaves it at half its
    /// slots, and giving that back would have it rebuilt again with every few percent it grew.
    pub fn shrink(&mut self) {
        if std::mem::take(&mut self.reserved)
            && self.len * SHRINK_BELOW.1 < self.slots() * SHRINK_BELOW.0
        {
            self.rebuild(form_for(self.len, SHRUNK_TO));
        }
    }

    /// Fetches the block where `digest` would be, ahead of an [`DigestSet::insert`] of it.
    pub fn prefetch(&self, digest: u32) {
        match &self.form {
            Form::Wide(b) => b.prefetch(mix(digest)),
            Form::Narrow(b) => b.prefetch(mix(digest)),
        }
    }

    /// Digests in the set.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes its blocks and its overflow take.
    pub fn bytes(&self) -> usize {
        let (blocks, overflow) = match &self.form {
            Form::Wide(b) => (b.len(), b.overflow.capacity()),
            Form::Narrow(b) => (b.len(), b.overflow.capacity()),
        };
        blocks * 64 + overflow * 5
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn blocks(set: &DigestSet) -> usize {
        match &set.form {
            Form::Wide(b) => b.len(),
            Form::Narrow(b) => b.len(),
        }
    }

    fn narrow(set: &DigestSet) -> bool {
        matches!(set.form, Form::Narrow(_))
    }

    fn overflowed(set: &DigestSet) -> usize {
        match &set.form {
            Form::Wide(b) => b.overflow.len(),
            Form::Narrow(b) => b.overflow.len(),
        }
    }

    fn held(set: &DigestSet) -> HashSet<u32> {
        match &set.form {
            Form::Wide(b) => b.digests().collect(),
            Form::Narrow(b) => b.digests().collect(),
        }
    }

    #[test]
    fn a_block_is_one_cache_line_and_the_mix_is_undone() {
        assert_eq!(size_of::<Block<u16>>(), 64);
        assert_eq!(size_of::<Block<u32>>(), 64);
        for d in values(1, 10_000, u32::MAX)
            .into_iter()
            .chain([0, 1, u32::MAX])
        {
            assert_eq!(unmix(mix(d)), d);
        }
    }

    #[test]
    fn a_digest_set_agrees_with_the_standard_set_through_inserts_and_removals() {
        // A small range makes removals of what was just put in common; the full range grows
        // the set through both widths.
        for (range, n) in [(50, 40_000), (5_000, 40_000), (u32::MAX, 3_000_000)] {
            let mut mine = DigestSet::default();
            let mut theirs = HashSet::new();
            for (i, &d) in values(range as u64, n, range).iter().enumerate() {
                if i % 3 == 2 {
                    assert_eq!(mine.remove(d), theirs.remove(&d), "remove {d}");
                } else {
                    assert_eq!(mine.insert(d), theirs.insert(d), "insert {d}");
                }
                assert_eq!(mine.len(), theirs.len());
            }
            for d in values(7, 20_000, range) {
                assert_eq!(mine.contains(d), theirs.contains(&d), "contains {d}");
            }
            assert_eq!(held(&mine), theirs, "every digest given back whole");
            assert_eq!(range == u32::MAX, narrow(&mine), "{} digests", mine.len());
        }
    }

    #[test]
    fn digests_crowded_into_one_block_go_to_the_next_then_to_the_overflow() {
        let mut set = DigestSet::default();
        set.reserve(1_000_000);
        assert!(narrow(&set));
        let b = match &set.form {
            Form::Narrow(b) => b.len(),
            Form::Wide(_) => unreachable!(),
        };
        // Every digest whose mix lies in block 100: there are about 2^32 / b of them.
        let start = ((100u64 << 32).div_ceil(b as u64)) as u32;
        let crowd: Vec<u32> = (0..200).map(|i| unmix(start + i * 3)).collect();
        for &d in &crowd {
            assert!(set.insert(d));
        }
        let others = values(9, 50_000, u32::MAX);
        for &d in &others {
            set.insert(d);
        }
        assert!(overflowed(&set) >= 200 - 2 * u16::PER_BLOCK);
        assert_eq!(blocks(&set), b, "a crowd does not grow the set");
        for &d in &crowd {
            assert!(set.contains(d), "{d} lost");
        }
        // Taken out in an order that empties guests and own slots alike.
        for &d in crowd.iter().rev().step_by(2) {
            assert!(set.remove(d) && !set.contains(d));
        }
        for &d in crowd.iter().rev().skip(1).step_by(2) {
            assert!(set.contains(d), "{d} lost after removals");
        }
        assert!(others.iter().all(|&d| set.contains(d)));
    }

    #[test]
    fn room_made_at_once_is_enough_for_what_was_announced_and_keeps_what_was_held() {
        let mut set = DigestSet::default();
        let held_before = values(1, 1_000, u32::MAX);
        for &d in &held_before {
            set.insert(d);
        }
        let coming = values(2, 1_500_000, u32::MAX);
        set.reserve(coming.len());
        let room = blocks(&set);
        for &d in &coming {
            set.insert(d);
        }
        assert_eq!(blocks(&set), room, "no growth after the room made");
        assert!(held_before.iter().chain(&coming).all(|&d| set.contains(d)));
        // Room for what was announced, no more than the load allows: under 3 bytes a digest.
        assert!(set.bytes() * 10 < set.len() * 30, "{} bytes", set.bytes());
        assert!(set.len() * MAX_LOAD.1 <= room * u16::PER_BLOCK * MAX_LOAD.0);
    }

    #[test]
    fn room_left_by_digests_that_went_is_given_back_and_what_stays_is_kept() {
        let mut set = DigestSet::default();
        let all = values(3, 3_000_000, u32::MAX);
        set.reserve(all.len());
        for &d in &all {
            set.insert(d);
        }
        let (stay, go) = all.split_at(1_600_000);
        for &d in go {
            set.remove(d);
        }
        let before = blocks(&set);
        set.shrink();
        let after = blocks(&set);
        // At the load it leaves, well below the room made.
        let len = set.len();
        assert!(after * 10 < before * 6, "{before} blocks, then {after}");
        assert!(
            after * u16::PER_BLOCK * SHRUNK_TO.0 >= len * SHRUNK_TO.1,
            "{after} blocks for {len}"
        );
        let (stay, go): (HashSet<u32>, HashSet<u32>) =
            (stay.iter().copied().collect(), go.iter().copied().collect());
        assert!(stay.difference(&go).all(|&d| set.contains(d)));
        assert!(go.difference(&stay).all(|&d| !set.contains(d)));
        // A set at its load is left as it is.
        set.shrink();
        assert_eq!(blocks(&set), after);
        // So is one that grew by inserts, below that load just after growing.
        let mut grown = DigestSet::default();
        let mut digests = values(5, 100_000, u32::MAX).into_iter();
        while blocks(&grown) < 64 || grown.len() * SHRINK_BELOW.1 >= grown.slots() * SHRINK_BELOW.0
        {
            grown.insert(digests.next().expect("enough digests"));
        }
        let room = blocks(&grown);
        grown.shrink();
        assert_eq!(blocks(&grown), room, "room made by growing was given back");
    }

    #[test]
    fn zero_is_a_digest_like_any_other_and_an_empty_set_answers() {
        let mut set = DigestSet::default();
        assert!(!set.contains(0) && !set.remove(0));
        set.prefetch(0);
        assert!(set.insert(0) && !set.insert(0));
        assert!(set.contains(0) && set.len() == 1);
        assert!(set.remove(0) && !set.remove(0));
        assert!(set.is_empty());
    }
}
