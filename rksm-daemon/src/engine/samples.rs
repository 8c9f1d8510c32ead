//! The sample index: which digests of new pages (see `ebpf::sampler`) some other page of the
//! merge domain shares.
//!
//! Per digest it counts the pages read whole that have it and the pages only sampled that
//! have it. Most digests are one page's, only sampled: those are in a set of digests alone
//! ([`DigestSet`], about 2.7 bytes a digest once it is large), and only the others carry
//! their counts. A new page whose digest is
//! not kept is only sampled: never copied, never checksummed, never in the
//! [`Index`](super::index::Index). One whose digest is kept is read whole, and so are the
//! pages only sampled there: the index says only that there are some, and the scanner finds
//! them by their digest in the targets' pages (one walk of the pages only sampled, in a pass
//! where such pages were met). Only then do checksums and byte compares decide what is a
//! duplicate.

use std::{collections::HashSet, hash::BuildHasherDefault};

use super::{digests::DigestSet, keys::KeyHasher, pages::DigestChange, table::CountMap};

/// How many digests ahead of its lookup a digest's places are fetched
/// ([`SampleIndex::prefetch`]), where the digests of a batch, unrelated to each other, are
/// looked up one after another: each lookup would otherwise wait for memory in turn.
pub const AHEAD: usize = 16;

/// Bits of an entry: pages read whole (saturating), pages only sampled (saturating), and
/// whether pages of the digest are being read whole this pass (not counted yet). A count that
/// reached its largest value stays there: the entry is then kept for good, which costs a
/// page read whole now and then, never a duplicate missed.
const READ_BITS: u32 = 20;
const READ_MAX: u32 = (1 << READ_BITS) - 1;
const SAMPLED_MAX: u32 = (1 << 11) - 1;
const READING: u32 = 1 << 31;

fn read(v: u32) -> u32 {
    v & READ_MAX
}

fn sampled(v: u32) -> u32 {
    (v >> READ_BITS) & SAMPLED_MAX
}

fn with(read: u32, sampled: u32, reading: bool) -> u32 {
    read | (sampled << READ_BITS) | if reading { READING } else { 0 }
}

/// What a new page's digest meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meets {
    /// No other page: it is only sampled.
    Nothing,
    /// Pages read whole, or being read this pass: it is read whole.
    Company,
    /// Pages only sampled so far, which are now to be read whole too (found by the digest).
    Sampled,
}

/// The entry of a digest that one page only sampled has, and nothing else.
const LONE: u32 = 1 << READ_BITS;

#[derive(Debug, Default)]
pub struct SampleIndex {
    /// Every digest kept.
    digests: DigestSet,
    /// The entries of the digests kept that are not [`LONE`].
    counts: CountMap,
    /// Digests whose pages only sampled are to be read whole at the next look for them.
    wanted: HashSet<u32, BuildHasherDefault<KeyHasher>>,
}

impl SampleIndex {
    /// What a new page with `digest` meets; if nothing, it is counted as only sampled. If
    /// pages only sampled are met, the digest is wanted (see [`SampleIndex::take_wanted`])
    /// and marked as being read until a page of it is counted, so that further pages with
    /// it are read whole too.
    pub fn meet(&mut self, digest: u32) -> Meets {
        // One probe of the set for a digest met the first time (a trip to memory when it is
        // large), the common case.
        if self.digests.insert(digest) {
            return Meets::Nothing;
        }
        let v = self.counts.get(digest).unwrap_or(LONE);
        if read(v) > 0 || v & READING != 0 {
            return Meets::Company;
        }
        self.counts.set(digest, v | READING);
        self.wanted.insert(digest);
        Meets::Sampled
    }

    /// Makes room for `pages` new pages' digests, about to be met.
    pub fn reserve(&mut self, pages: usize) {
        self.digests.reserve(pages);
    }

    /// Gives back the room made for new pages whose digests left again (read whole and
    /// found one of a kind, or gone). The counts give back theirs only once three quarters
    /// of it are free: a map just grown is half free, and shrunk then it would grow again
    /// with the next few digests.
    pub fn shrink(&mut self) {
        self.digests.shrink();
        self.counts.compact();
    }

    /// Fetches what [`SampleIndex::meet`] of `digest` reads, a few pages ahead of it: the
    /// set's bucket, and the counts' for a digest met before. The counts are smaller than
    /// the set, but not so small as to stay in the cache while the set is read.
    pub fn prefetch(&self, digest: u32) {
        self.digests.prefetch(digest);
        self.counts.prefetch(digest);
    }

    /// The entry of `digest`, 0 if it is not kept.
    fn entry(&self, digest: u32) -> u32 {
        match self.counts.get(digest) {
            Some(v) => v,
            None if self.digests.contains(digest) => LONE,
            None => 0,
        }
    }

    /// Sets the entry of `digest` to `v`: dropped if 0, in the set alone if [`LONE`].
    fn set(&mut self, digest: u32, v: u32) {
        match v {
            0 => {
                self.digests.remove(digest);
                self.counts.remove(digest);
            }
            LONE => {
                self.digests.insert(digest);
                self.counts.remove(digest);
            }
            _ => {
                self.digests.insert(digest);
                self.counts.set(digest, v);
            }
        }
    }

    /// Pages read whole with `digests`, as [`SampleIndex::read_whole`] each: a batch's
    /// pages, whose digests are unrelated, so each lookup is fetched a few ahead of it.
    pub fn read_whole_all(&mut self, digests: &[u32]) {
        for (i, &digest) in digests.iter().enumerate() {
            if let Some(&ahead) = digests.get(i + AHEAD) {
                self.prefetch(ahead);
            }
            self.read_whole(digest);
        }
    }

    /// A page read whole with `digest`: if pages only sampled have it, they are wanted.
    pub fn read_whole(&mut self, digest: u32) {
        let v = self.entry(digest);
        if sampled(v) > 0 && v & READING == 0 {
            self.set(digest, v | READING);
            self.wanted.insert(digest);
        }
    }

    /// The digests whose pages only sampled are to be read whole, forgotten here.
    pub fn take_wanted(&mut self) -> HashSet<u32, BuildHasherDefault<KeyHasher>> {
        std::mem::take(&mut self.wanted)
    }

    /// Wants again those of `digests` that pages only sampled still have (in targets the
    /// last look did not cover: skipped for a pass, or of no target of that pass).
    pub fn want_again(&mut self, digests: impl IntoIterator<Item = u32>) {
        for d in digests {
            if sampled(self.entry(d)) > 0 {
                self.wanted.insert(d);
            }
        }
    }

    /// A page only sampled with `digest` was taken out to be read whole.
    pub fn unsample(&mut self, digest: u32) {
        self.change(digest, |r, s| (r, s.saturating_sub(1)));
    }

    /// Follows `changes` of a target's pages.
    pub fn follow(&mut self, changes: &[DigestChange]) {
        for (i, &change) in changes.iter().enumerate() {
            // A batch's changes, whose digests are unrelated, as in `read_whole_all`.
            if let Some(ahead) = changes.get(i + AHEAD) {
                self.prefetch(ahead.digest());
            }
            match change {
                DigestChange::Counted(d) => {
                    // Counted at least once from now on: never lone, so in `counts`.
                    let lone = !self.digests.insert(d);
                    let v = self.counts.get(d).unwrap_or(if lone { LONE } else { 0 });
                    self.counts
                        .set(d, with((read(v) + 1).min(READ_MAX), sampled(v), false));
                }
                DigestChange::Uncounted(d) => self.change(d, |r, s| (r.saturating_sub(1), s)),
                DigestChange::Unsampled(_, d) => self.unsample(d),
            }
        }
    }

    /// Applies `f` to the counts of `digest`, but for a count that saturated; drops the entry
    /// once nothing is counted and nothing is being read.
    fn change(&mut self, digest: u32, f: impl Fn(u32, u32) -> (u32, u32)) {
        let v = self.entry(digest);
        if v == 0 {
            return;
        }
        let (r, s) = (read(v), sampled(v));
        let (mut nr, mut ns) = f(r, s);
        if r == READ_MAX {
            nr = r;
        }
        if s == SAMPLED_MAX {
            ns = s;
        }
        self.set(digest, with(nr, ns, v & READING != 0));
    }

    /// Digests kept.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether no digest is kept.
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_digest_is_only_sampled_until_a_second_page_has_it() {
        let mut index = SampleIndex::default();
        assert_eq!(index.meet(7), Meets::Nothing);
        assert_eq!(index.meet(7), Meets::Sampled);
        assert_eq!(index.take_wanted().into_iter().collect::<Vec<_>>(), [7]);
        // Being read: a third page of the same pass is read too.
        assert_eq!(index.meet(7), Meets::Company);
        assert!(index.take_wanted().is_empty(), "wanted once");
        // The first page is taken out, both are read and counted; later pages meet them.
        index.unsample(7);
        index.follow(&[DigestChange::Counted(7), DigestChange::Counted(7)]);
        assert_eq!(index.meet(7), Meets::Company);
        index.follow(&[DigestChange::Uncounted(7), DigestChange::Uncounted(7)]);
        assert!(index.is_empty(), "gone with its last counted page");
    }

    #[test]
    fn a_page_read_whole_wants_the_pages_only_sampled_with_its_digest() {
        let mut index = SampleIndex::default();
        assert_eq!(index.meet(3), Meets::Nothing);
        index.read_whole(4);
        assert!(index.take_wanted().is_empty(), "no page only sampled has 4");
        index.read_whole(3);
        index.read_whole(3);
        assert_eq!(index.take_wanted().into_iter().collect::<Vec<_>>(), [3]);
        assert_eq!(index.meet(3), Meets::Company);
    }

    #[test]
    fn a_digest_whose_pages_only_sampled_were_not_all_found_is_wanted_again() {
        let mut index = SampleIndex::default();
        index.meet(1);
        index.meet(2);
        assert_eq!(index.meet(1), Meets::Sampled);
        assert_eq!(index.meet(2), Meets::Sampled);
        let wanted = index.take_wanted();
        // The page with digest 1 was found and taken out; the one with 2 was not.
        index.unsample(1);
        index.want_again(wanted);
        assert_eq!(index.take_wanted().into_iter().collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn a_digest_is_forgotten_when_its_last_page_leaves() {
        let mut index = SampleIndex::default();
        index.follow(&[DigestChange::Counted(5), DigestChange::Uncounted(5)]);
        assert!(index.is_empty());
        assert_eq!(index.meet(6), Meets::Nothing);
        index.follow(&[DigestChange::Unsampled(0x1000, 6)]);
        assert!(index.is_empty());
    }

    #[test]
    fn a_lone_digest_keeps_no_counts() {
        let mut index = SampleIndex::default();
        for d in 0..1000 {
            assert_eq!(index.meet(d), Meets::Nothing);
        }
        assert_eq!(index.len(), 1000);
        assert!(index.counts.is_empty(), "a lone digest is in the set alone");
        assert_eq!(index.meet(10), Meets::Sampled);
        assert_eq!(index.counts.len(), 1, "a second page gives it counts");
        index.unsample(10);
        index.follow(&[DigestChange::Counted(10)]);
        index.follow(&[DigestChange::Uncounted(10)]);
        assert!(index.counts.is_empty() && index.len() == 999, "10 gone");
        index.unsample(11);
        assert_eq!(index.len(), 998, "11's only page left");
    }

    #[test]
    fn a_saturated_count_stays() {
        let mut index = SampleIndex::default();
        let many = vec![DigestChange::Counted(9); READ_MAX as usize + 5];
        index.follow(&many);
        index.follow(&[DigestChange::Uncounted(9)]);
        assert_eq!(index.meet(9), Meets::Company);
        assert_eq!(index.len(), 1);
    }
}
