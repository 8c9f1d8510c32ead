//! Address ranges, and sets of them: the one range algebra every layer shares.
//!
//! The kernel hands rksm address ranges everywhere: VMAs, userfaultfd registrations,
//! `madvise` runs, backed-off regions. A [`RangeSet`] keeps ranges sorted, disjoint, and with
//! adjacent ones merged, so that "is this page inside?" is a binary search and "what is left
//! to mark?" is one subtraction.

use rksm_common::PAGE_SIZE;

/// A range of whole pages, `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Range {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
}

impl Range {
    /// `start..end`.
    pub fn new(start: u64, end: u64) -> Self {
        Range { start, end }
    }

    /// Pages in the range.
    pub fn pages(&self) -> u64 {
        (self.end - self.start) / PAGE_SIZE
    }

    /// The part of `self` inside `other`, if any.
    pub fn intersect(&self, other: &Range) -> Option<Range> {
        let (start, end) = (self.start.max(other.start), self.end.min(other.end));
        (start < end).then_some(Range { start, end })
    }
}

/// Sorted, disjoint ranges, adjacent ones merged.
///
/// ```
/// use rksm::kernel::ranges::{Range, RangeSet};
/// let mut set = RangeSet::default();
/// set.insert(Range::new(0x1000, 0x3000));
/// set.insert(Range::new(0x3000, 0x4000));
/// assert_eq!(set.as_slice(), [Range::new(0x1000, 0x4000)]);
/// assert!(set.contains(0x3000) && !set.contains(0x4000));
/// assert_eq!(set.minus(&[Range::new(0, 0x2000)]), [Range::new(0, 0x1000)]);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet(Vec<Range>);

impl RangeSet {
    /// The set of `ranges` (in any order, overlapping or not).
    pub fn of(ranges: &[Range]) -> RangeSet {
        let mut set = RangeSet::default();
        set.union(ranges);
        set
    }

    /// The ranges, sorted.
    pub fn as_slice(&self) -> &[Range] {
        &self.0
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Pages covered.
    pub fn pages(&self) -> u64 {
        self.0.iter().map(Range::pages).sum()
    }

    /// Whether `addr` is inside one of the ranges (binary search).
    pub fn contains(&self, addr: u64) -> bool {
        let i = self.0.partition_point(|r| r.end <= addr);
        self.0.get(i).is_some_and(|r| r.start <= addr)
    }

    /// Whether `start..end` is covered entirely by one range.
    pub fn covers(&self, start: u64, end: u64) -> bool {
        let i = self.0.partition_point(|r| r.end <= start);
        self.0
            .get(i)
            .is_some_and(|r| r.start <= start && end <= r.end)
    }

    /// Adds `range`.
    pub fn insert(&mut self, range: Range) {
        self.union(&[range]);
    }

    /// Adds every range of `new`.
    pub fn union(&mut self, new: &[Range]) {
        if new.is_empty() {
            return;
        }
        self.0.extend_from_slice(new);
        self.0.sort_unstable();
        let mut merged: Vec<Range> = Vec::with_capacity(self.0.len());
        for range in self.0.drain(..) {
            match merged.last_mut() {
                Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
                _ => merged.push(range),
            }
        }
        self.0 = merged;
    }

    /// Removes every range of `cut`.
    pub fn remove(&mut self, cut: &[Range]) {
        let mut rest = Vec::with_capacity(self.0.len());
        for range in &self.0 {
            rest.extend(subtract_one(*range, cut));
        }
        self.0 = rest;
    }

    /// The parts of `ranges` (sorted) not in the set.
    pub fn minus(&self, ranges: &[Range]) -> Vec<Range> {
        ranges
            .iter()
            .flat_map(|&range| subtract_one(range, &self.0))
            .collect()
    }

    /// The ranges of the set that overlap `within`, clipped to it.
    pub fn within(&self, within: Range) -> Vec<Range> {
        self.0.iter().filter_map(|r| r.intersect(&within)).collect()
    }

    /// The parts of the set inside one of `spans` (a process's VMAs, say).
    pub fn clip_to(&self, spans: impl IntoIterator<Item = Range>) -> RangeSet {
        let spans: Vec<Range> = spans.into_iter().collect();
        let mut out = RangeSet::default();
        let clipped: Vec<Range> = self
            .0
            .iter()
            .flat_map(|r| spans.iter().filter_map(move |span| r.intersect(span)))
            .collect();
        out.union(&clipped);
        out
    }

    /// The parts common to both sets.
    pub fn intersection(&self, other: &RangeSet) -> RangeSet {
        let mut out = RangeSet::default();
        let common: Vec<Range> = self
            .0
            .iter()
            .flat_map(|a| other.0.iter().filter_map(move |b| a.intersect(b)))
            .collect();
        out.union(&common);
        out
    }
}

/// The runs of consecutive pages in `pages` (sorted page addresses), each at most `max_len`
/// long: one system call per run where pages are asked about one run at a time.
pub fn page_runs(pages: &[u64], max_len: usize) -> impl Iterator<Item = &[u64]> {
    let mut rest = pages;
    std::iter::from_fn(move || {
        let first = *rest.first()?;
        let len = rest
            .iter()
            .take(max_len.max(1))
            .enumerate()
            .take_while(|&(i, &p)| p == first + i as u64 * PAGE_SIZE)
            .count();
        let (run, tail) = rest.split_at(len);
        rest = tail;
        Some(run)
    })
}

/// `range` without the (sorted) ranges of `cut`.
fn subtract_one(range: Range, cut: &[Range]) -> Vec<Range> {
    let mut out = Vec::new();
    let mut start = range.start;
    let first = cut.partition_point(|c| c.end <= range.start);
    for c in cut[first..].iter().take_while(|c| c.start < range.end) {
        if c.start > start {
            out.push(Range::new(start, c.start));
        }
        start = start.max(c.end);
    }
    if start < range.end {
        out.push(Range::new(start, range.end));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_runs_split_at_gaps_and_at_the_length_cap() {
        let p = PAGE_SIZE;
        let pages = [p, 2 * p, 3 * p, 7 * p, 8 * p, 20 * p];
        let runs: Vec<&[u64]> = page_runs(&pages, 2).collect();
        assert_eq!(
            runs,
            [&[p, 2 * p][..], &[3 * p], &[7 * p, 8 * p], &[20 * p]]
        );
        assert_eq!(page_runs(&[], 8).count(), 0);
    }

    fn set(ranges: &[(u64, u64)]) -> RangeSet {
        let mut s = RangeSet::default();
        s.union(
            &ranges
                .iter()
                .map(|&(a, b)| Range::new(a, b))
                .collect::<Vec<_>>(),
        );
        s
    }

    #[test]
    fn coverage_survives_splits_and_follows_unmaps() {
        let ranges = set(&[(0x1000, 0x9000)]);
        // The VMA was split in three by a mergeable run: still covered.
        let split = [
            Range::new(0x1000, 0x3000),
            Range::new(0x3000, 0x5000),
            Range::new(0x5000, 0x9000),
        ];
        let clipped = ranges.clip_to(split);
        assert!(split.iter().all(|r| clipped.covers(r.start, r.end)));
        // The middle was unmapped: coverage shrinks with it, a new VMA there is not covered.
        let mut clipped = ranges.clip_to([Range::new(0x1000, 0x3000), Range::new(0x5000, 0x9000)]);
        assert_eq!(clipped, set(&[(0x1000, 0x3000), (0x5000, 0x9000)]));
        assert!(!clipped.covers(0x3000, 0x5000));
        clipped.remove(&[Range::new(0x6000, 0x7000)]);
        assert_eq!(
            clipped,
            set(&[(0x1000, 0x3000), (0x5000, 0x6000), (0x7000, 0x9000)])
        );
        let mut adjacent = set(&[(0x1000, 0x9000)]);
        adjacent.insert(Range::new(0x9000, 0xa000));
        assert_eq!(adjacent, set(&[(0x1000, 0xa000)]), "adjacent ranges merge");
    }

    #[test]
    fn minus_leaves_only_what_is_not_in_the_set() {
        let marked = set(&[(0x2000, 0x4000), (0x6000, 0x7000)]);
        assert_eq!(
            marked.minus(&[Range::new(0x1000, 0x8000)]),
            [
                Range::new(0x1000, 0x2000),
                Range::new(0x4000, 0x6000),
                Range::new(0x7000, 0x8000)
            ]
        );
        assert_eq!(marked.minus(&[Range::new(0x2000, 0x3000)]), []);
        assert_eq!(
            marked.within(Range::new(0x3000, 0x6800)),
            [Range::new(0x3000, 0x4000), Range::new(0x6000, 0x6800)]
        );
    }

    #[test]
    fn membership_is_exact_at_the_edges() {
        let s = set(&[(0x1000, 0x3000), (0x5000, 0x6000)]);
        for (addr, inside) in [
            (0x0, false),
            (0x1000, true),
            (0x2fff, true),
            (0x3000, false),
            (0x5000, true),
            (0x6000, false),
        ] {
            assert_eq!(s.contains(addr), inside, "{addr:#x}");
        }
        assert_eq!(
            s.intersection(&set(&[(0x2000, 0x5800)])),
            set(&[(0x2000, 0x3000), (0x5000, 0x5800)])
        );
        assert_eq!(s.pages(), 3);
    }
}
