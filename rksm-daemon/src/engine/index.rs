//! The dedup index: KSM's stable and unstable trees, keyed by checksum, decided by content.
//!
//! KSM finds identical pages with two trees. The *unstable tree* holds pages whose checksum
//! did not change since the previous pass (the checksum gate) and is rebuilt from scratch on
//! every pass, because its pages can change under it. The *stable tree* holds contents that are
//! already merged and persists. rksm keeps those semantics. Its trees are B-trees keyed by
//! checksum (a B-tree beats node-per-entry trees at millions of entries), and each key leads to
//! a chain of *content classes*: pages whose contents were compared equal, byte for byte. A
//! checksum only says where to look; two pages join a class only after their contents compare
//! equal, so a collision (crc32c has one in ~78,000 random pages) costs a comparison, never a
//! wrong answer.
//!
//! To compare, the index needs the content of a class's representative page, which lives in
//! another process. It keeps a bounded cache of representatives that have duplicates (the ones
//! compared again and again) and re-reads the others through a [`ContentSource`]. A
//! representative that can no longer be read, or whose checksum moved, makes its class *stale*:
//! it is never matched again, and the next page with that content starts a new class.

use std::collections::{BTreeMap, HashMap, VecDeque};

use rksm_common::PAGE_SIZE;

use crate::engine::checksum::{ChecksumKind, PageChecksum};

const PAGE: usize = PAGE_SIZE as usize;

/// One page of one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageRef {
    /// Process id.
    pub pid: u32,
    /// Page-aligned virtual address.
    pub addr: u64,
}

/// Reads the current content of a page, for comparisons.
pub trait ContentSource {
    /// Fills `buf` with the content of `page`; false if it cannot be read (unmapped, exited).
    fn read(&mut self, page: PageRef, buf: &mut [u8; PAGE]) -> bool;
}

/// The content of the page being placed, if the caller already has it.
#[derive(Debug, Clone, Copy)]
pub enum Content<'a> {
    /// Read this pass.
    Loaded(&'a [u8]),
    /// Mapped to the kernel's zero page: all zeros, nothing to read.
    Zero,
    /// Not read this pass (the dirty source says it is clean); read it only if a comparison
    /// needs it, and check it still has the checksum recorded for it.
    Unread,
    /// Clean, and already marked mergeable: no decision depends on it any more (ksmd
    /// compares contents itself before merging), so it joins the first live class with its
    /// checksum without being read. Under a checksum collision that miscounts a duplicate;
    /// it never marks anything.
    Settled,
}

/// Where a page ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The first page seen with this content this pass: it stays.
    Unique,
    /// Its content equals an earlier page's (or a merged page's): merging would free it.
    Duplicate {
        /// The first page seen with this content (its class's representative): marking both
        /// lets ksmd merge them.
        of: PageRef,
    },
    /// Its checksum changed since the previous pass: kept out of the unstable tree.
    Volatile,
    /// Its content was needed for a comparison but could not be read.
    Vanished,
}

/// Index of a content class within one tree.
type ClassId = u32;
const NONE: ClassId = ClassId::MAX;

/// Pages with one content (compared equal). 24 bytes: the checksum is the tree's key.
#[derive(Debug, Clone)]
struct Class {
    rep_addr: u64,
    rep_pid: u32,
    /// Pages placed in this class this pass.
    copies: u32,
    /// Next class with the same checksum (a collision chain), or NONE.
    next: ClassId,
    stale: bool,
    zero: bool,
}

/// A most-duplicated content.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TopContent {
    /// Its checksum.
    pub checksum: u64,
    /// Pages holding it this pass.
    pub copies: u32,
    /// Whether it is the all-zero page.
    pub zero: bool,
    /// Processes holding it.
    pub pids: Vec<u32>,
}

/// Representative contents kept in memory, first in first out.
#[derive(Debug, Default)]
struct RepCache {
    pages: HashMap<ClassId, Box<[u8; PAGE]>>,
    order: VecDeque<ClassId>,
    capacity: usize,
}

impl RepCache {
    fn insert(&mut self, id: ClassId, content: &[u8; PAGE]) {
        if self.capacity == 0 || self.pages.contains_key(&id) {
            return;
        }
        if self.order.len() == self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.pages.remove(&old);
            }
        }
        self.pages.insert(id, Box::new(*content));
        self.order.push_back(id);
    }

    fn clear(&mut self) {
        self.pages.clear();
        self.order.clear();
    }
}

/// One tree: checksum → chain of content classes.
#[derive(Debug, Default)]
struct ContentTree {
    heads: BTreeMap<u64, ClassId>,
    classes: Vec<Class>,
    /// Processes holding each class that has more than one copy (for the top-N report).
    holders: HashMap<ClassId, Vec<u32>>,
    cache: RepCache,
}

enum Lookup {
    Found(ClassId),
    Missing,
    Vanished,
}

impl ContentTree {
    fn with_cache(capacity: usize) -> Self {
        ContentTree {
            cache: RepCache {
                capacity,
                ..RepCache::default()
            },
            ..ContentTree::default()
        }
    }

    fn clear(&mut self) {
        self.heads.clear();
        self.classes.clear();
        self.holders.clear();
        self.cache.clear();
    }

    /// Finds the class whose content equals the page's, comparing contents.
    fn find(
        &mut self,
        checksum: u64,
        page: &mut PageUnderTest<'_>,
        src: &mut dyn ContentSource,
        hash: PageChecksum,
    ) -> Lookup {
        let mut id = self.heads.get(&checksum).copied().unwrap_or(NONE);
        let mut rep = [0u8; PAGE];
        while id != NONE {
            let class = &self.classes[id as usize];
            let next = class.next;
            if !class.stale && matches!(page.content, Content::Settled) {
                return Lookup::Found(id);
            }
            if !class.stale {
                let rep_content: &[u8; PAGE] = if class.zero {
                    &ZERO_PAGE
                } else if let Some(cached) = self.cache.pages.get(&id) {
                    cached
                } else {
                    let rep_page = PageRef {
                        pid: class.rep_pid,
                        addr: class.rep_addr,
                    };
                    if !src.read(rep_page, &mut rep) || hash(&rep) != checksum {
                        self.classes[id as usize].stale = true;
                        id = next;
                        continue;
                    }
                    &rep
                };
                match page.content(src, hash, checksum) {
                    None => return Lookup::Vanished,
                    Some(mine) if mine == &rep_content[..] => {
                        if !self.cache.pages.contains_key(&id) {
                            let rep_copy = *rep_content;
                            self.cache.insert(id, &rep_copy);
                        }
                        return Lookup::Found(id);
                    }
                    Some(_) => {}
                }
            }
            id = next;
        }
        Lookup::Missing
    }

    /// Adds a page of `pid` to class `id`; returns the class's representative.
    fn join(&mut self, id: ClassId, pid: u32) -> PageRef {
        let class = &mut self.classes[id as usize];
        class.copies += 1;
        let rep_pid = class.rep_pid;
        let rep = PageRef {
            pid: rep_pid,
            addr: class.rep_addr,
        };
        let holders = self.holders.entry(id).or_insert_with(|| vec![rep_pid]);
        if !holders.contains(&pid) {
            holders.push(pid);
        }
        rep
    }

    fn insert(&mut self, checksum: u64, page: PageRef, zero: bool) -> ClassId {
        let id = self.classes.len() as ClassId;
        let next = self.heads.insert(checksum, id).unwrap_or(NONE);
        self.classes.push(Class {
            rep_addr: page.addr,
            rep_pid: page.pid,
            copies: 1,
            next,
            stale: false,
            zero,
        });
        id
    }

    /// Every class with its checksum.
    fn classes_with_checksums(&self) -> impl Iterator<Item = (u64, ClassId)> + '_ {
        self.heads.iter().flat_map(move |(&checksum, &head)| {
            std::iter::successors(Some(head), move |&id| {
                Some(self.classes[id as usize].next).filter(|&n| n != NONE)
            })
            .map(move |id| (checksum, id))
        })
    }

    /// Starts a pass for a tree that persists: counts restart, stale classes go.
    fn begin_pass_keeping_classes(&mut self) {
        let live: Vec<(u64, Class)> = self
            .classes_with_checksums()
            .map(|(checksum, id)| (checksum, self.classes[id as usize].clone()))
            .filter(|(_, class)| !class.stale)
            .collect();
        self.clear();
        for (checksum, class) in live {
            let page = PageRef {
                pid: class.rep_pid,
                addr: class.rep_addr,
            };
            let id = self.insert(checksum, page, class.zero);
            self.classes[id as usize].copies = 0;
        }
    }

    /// Empties the tree, with room for `classes` classes, so that filling it never doubles
    /// the class vector (which would cost up to 24 more bytes per page).
    fn reset_with_capacity(&mut self, classes: usize) {
        self.clear();
        self.classes = Vec::with_capacity(classes);
    }

    fn top(&self) -> impl Iterator<Item = TopContent> + '_ {
        let checksums: HashMap<ClassId, u64> = self
            .classes_with_checksums()
            .filter(|(_, id)| self.holders.contains_key(id))
            .map(|(checksum, id)| (id, checksum))
            .collect();
        self.holders.iter().map(move |(&id, pids)| {
            let class = &self.classes[id as usize];
            let mut pids = pids.clone();
            pids.sort_unstable();
            TopContent {
                checksum: checksums[&id],
                copies: class.copies,
                zero: class.zero,
                pids,
            }
        })
    }
}

static ZERO_PAGE: [u8; PAGE] = [0; PAGE];

/// The page being placed, with its content loaded at most once.
struct PageUnderTest<'a> {
    page: PageRef,
    content: Content<'a>,
    loaded: Option<Box<[u8; PAGE]>>,
    vanished: bool,
}

impl PageUnderTest<'_> {
    fn content(
        &mut self,
        src: &mut dyn ContentSource,
        hash: PageChecksum,
        checksum: u64,
    ) -> Option<&[u8]> {
        match self.content {
            Content::Loaded(bytes) => Some(bytes),
            Content::Zero => Some(&ZERO_PAGE),
            Content::Unread | Content::Settled => {
                if self.loaded.is_none() && !self.vanished {
                    let mut buf = Box::new([0u8; PAGE]);
                    // A page the dirty source called clean must still have its checksum; if
                    // not, the source was wrong and the page is treated as gone this pass.
                    if src.read(self.page, &mut buf) && hash(&buf[..]) == checksum {
                        self.loaded = Some(buf);
                    } else {
                        self.vanished = true;
                    }
                }
                self.loaded.as_deref().map(|b| &b[..])
            }
        }
    }
}

/// The stable and unstable trees, with KSM's rules for placing a page.
#[derive(Debug)]
pub struct Index {
    hash: PageChecksum,
    zero_checksum: u64,
    stable: ContentTree,
    unstable: ContentTree,
    /// Pages placed in the current pass, to size the next pass's unstable tree.
    placed: usize,
}

/// Representatives kept in memory per tree: 4096 pages, 16 MiB.
pub const DEFAULT_CACHE_PAGES: usize = 4096;

impl Index {
    /// An empty index for checksums of `kind`.
    pub fn new(kind: ChecksumKind) -> Self {
        Self::with_cache(kind, DEFAULT_CACHE_PAGES)
    }

    /// An empty index that keeps at most `cache_pages` representative contents per tree.
    pub fn with_cache(kind: ChecksumKind, cache_pages: usize) -> Self {
        Self::with_checksum(kind.function(), cache_pages)
    }

    /// An empty index using any page checksum: tests force collisions with a weak one.
    pub fn with_checksum(hash: PageChecksum, cache_pages: usize) -> Self {
        Index {
            hash,
            zero_checksum: hash(&ZERO_PAGE),
            stable: ContentTree::with_cache(cache_pages),
            unstable: ContentTree::with_cache(cache_pages),
            placed: 0,
        }
    }

    /// Starts a pass: the unstable tree is emptied, the stable tree keeps its contents.
    pub fn begin_pass(&mut self) {
        // At most every page placed last pass enters the unstable tree this pass.
        self.unstable
            .reset_with_capacity(self.placed + self.placed / 16);
        self.placed = 0;
        self.stable.begin_pass_keeping_classes();
    }

    /// Places one page, following KSM: a merged page (`ksm`) goes to the stable tree; any
    /// other page is first looked up in the stable tree, then must pass the checksum gate
    /// (`checksum == previous`), then is looked up in or added to the unstable tree.
    pub fn place(
        &mut self,
        page: PageRef,
        checksum: u64,
        previous: u64,
        ksm: bool,
        content: Content<'_>,
        src: &mut dyn ContentSource,
    ) -> Placement {
        let hash = self.hash;
        self.placed += 1;
        let mut under_test = PageUnderTest {
            page,
            content,
            loaded: None,
            vanished: false,
        };
        if ksm {
            // Merged content may also sit in the unstable tree already (an unmerged copy seen
            // earlier this pass): then this page is the extra copy.
            let in_unstable = match self.unstable.find(checksum, &mut under_test, src, hash) {
                Lookup::Found(id) => Some(self.unstable.join(id, page.pid)),
                Lookup::Vanished => return Placement::Vanished,
                Lookup::Missing => None,
            };
            return match self.stable.find(checksum, &mut under_test, src, hash) {
                Lookup::Found(id) => Placement::Duplicate {
                    of: self.stable.join(id, page.pid),
                },
                Lookup::Vanished => Placement::Vanished,
                Lookup::Missing => {
                    let zero = self.is_zero(checksum, &mut under_test, src);
                    self.stable.insert(checksum, page, zero);
                    match in_unstable {
                        Some(of) => Placement::Duplicate { of },
                        None => Placement::Unique,
                    }
                }
            };
        }
        match self.stable.find(checksum, &mut under_test, src, hash) {
            Lookup::Found(id) => {
                return Placement::Duplicate {
                    of: self.stable.join(id, page.pid),
                }
            }
            Lookup::Vanished => return Placement::Vanished,
            Lookup::Missing => {}
        }
        if checksum != previous {
            return Placement::Volatile;
        }
        match self.unstable.find(checksum, &mut under_test, src, hash) {
            Lookup::Found(id) => Placement::Duplicate {
                of: self.unstable.join(id, page.pid),
            },
            Lookup::Vanished => Placement::Vanished,
            Lookup::Missing => {
                let zero = self.is_zero(checksum, &mut under_test, src);
                if under_test.vanished {
                    return Placement::Vanished;
                }
                self.unstable.insert(checksum, page, zero);
                Placement::Unique
            }
        }
    }

    fn is_zero(
        &self,
        checksum: u64,
        page: &mut PageUnderTest<'_>,
        src: &mut dyn ContentSource,
    ) -> bool {
        checksum == self.zero_checksum
            && page
                .content(src, self.hash, checksum)
                .is_some_and(|c| c.iter().all(|&b| b == 0))
    }

    /// The `n` contents with the most copies this pass, most first.
    pub fn top(&self, n: usize) -> Vec<TopContent> {
        let mut all: Vec<TopContent> = self.stable.top().chain(self.unstable.top()).collect();
        all.sort_unstable_by(|a, b| b.copies.cmp(&a.copies).then(a.checksum.cmp(&b.checksum)));
        all.truncate(n);
        all
    }

    /// Number of content classes in (stable, unstable) tree.
    pub fn classes(&self) -> (usize, usize) {
        (self.stable.classes.len(), self.unstable.classes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated address space: page → content, with a read counter.
    #[derive(Default)]
    struct Memory {
        pages: HashMap<PageRef, [u8; PAGE]>,
        reads: usize,
    }

    impl Memory {
        fn set(&mut self, pid: u32, index: u64, fill: u8) -> PageRef {
            let page = PageRef {
                pid,
                addr: index * PAGE_SIZE,
            };
            self.pages.insert(page, [fill; PAGE]);
            page
        }
    }

    impl ContentSource for Memory {
        fn read(&mut self, page: PageRef, buf: &mut [u8; PAGE]) -> bool {
            self.reads += 1;
            match self.pages.get(&page) {
                Some(content) => {
                    *buf = *content;
                    true
                }
                None => false,
            }
        }
    }

    /// Places `page` with its current content, as a scan that read it would.
    fn place(
        index: &mut Index,
        mem: &mut Memory,
        page: PageRef,
        checksum: u64,
        previous: u64,
    ) -> Placement {
        let content = mem.pages[&page];
        index.place(
            page,
            checksum,
            previous,
            false,
            Content::Loaded(&content),
            mem,
        )
    }

    /// A deliberately weak checksum: every page collides with every other.
    const WEAK: u64 = 42;

    #[test]
    fn the_gate_keeps_changed_pages_out_of_the_unstable_tree() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let a = mem.set(1, 0, 7);
        let b = mem.set(2, 0, 7);
        let sum = kind.checksum(&[7; PAGE]);
        index.begin_pass();
        // First pass: no previous checksum, so nothing enters the unstable tree.
        assert_eq!(
            place(
                &mut index,
                &mut mem,
                a,
                sum,
                crate::engine::checksum::NO_CHECKSUM
            ),
            Placement::Volatile
        );
        assert_eq!(
            place(
                &mut index,
                &mut mem,
                b,
                sum,
                crate::engine::checksum::NO_CHECKSUM
            ),
            Placement::Volatile
        );
        assert_eq!(index.classes(), (0, 0));
        // Second pass: unchanged, so they meet in the unstable tree.
        index.begin_pass();
        assert_eq!(place(&mut index, &mut mem, a, sum, sum), Placement::Unique);
        assert_eq!(
            place(&mut index, &mut mem, b, sum, sum),
            Placement::Duplicate { of: a }
        );
        // A page that changed since its previous checksum stays out even if it now matches.
        let c = mem.set(3, 0, 7);
        assert_eq!(
            place(&mut index, &mut mem, c, sum, sum ^ 1),
            Placement::Volatile
        );
    }

    #[test]
    fn the_unstable_tree_is_rebuilt_every_pass() {
        let mut index = Index::new(ChecksumKind::Xxh64);
        let mut mem = Memory::default();
        let a = mem.set(1, 0, 1);
        let b = mem.set(2, 0, 1);
        index.begin_pass();
        assert_eq!(place(&mut index, &mut mem, a, 5, 5), Placement::Unique);
        index.begin_pass();
        assert_eq!(index.classes().1, 0, "unstable tree not reset");
        // b would be a duplicate of a only if a were still in the tree.
        assert_eq!(place(&mut index, &mut mem, b, 5, 5), Placement::Unique);
    }

    #[test]
    fn collisions_are_decided_by_content() {
        // Every page collides with every other under this checksum.
        let mut index = Index::with_checksum(|_| WEAK, 0);
        let mut mem = Memory::default();
        let pages: Vec<PageRef> = (0..6).map(|i| mem.set(1, i, (i % 3) as u8 + 1)).collect();
        index.begin_pass();
        let placed: Vec<Placement> = pages
            .iter()
            .map(|&p| place(&mut index, &mut mem, p, WEAK, WEAK))
            .collect();
        use Placement::*;
        // Contents 1,2,3,1,2,3 under one checksum: three classes, three duplicates.
        assert_eq!(
            placed,
            [
                Unique,
                Unique,
                Unique,
                Duplicate { of: pages[0] },
                Duplicate { of: pages[1] },
                Duplicate { of: pages[2] }
            ]
        );
        assert_eq!(index.classes().1, 3);
        let top = index.top(10);
        assert_eq!(top.len(), 3);
        assert!(top.iter().all(|t| t.copies == 2 && t.checksum == WEAK));
    }

    #[test]
    fn a_representative_that_changed_is_never_matched() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::with_cache(kind, 0);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[9; PAGE]);
        let a = mem.set(1, 0, 9);
        index.begin_pass();
        assert_eq!(place(&mut index, &mut mem, a, sum, sum), Placement::Unique);
        mem.set(1, 0, 8); // a is rewritten after it was placed
        let b = mem.set(2, 0, 9);
        // b's content equals a's *old* content; a is stale now, so b starts a new class.
        assert_eq!(place(&mut index, &mut mem, b, sum, sum), Placement::Unique);
        let c = mem.set(3, 0, 9);
        assert_eq!(
            place(&mut index, &mut mem, c, sum, sum),
            Placement::Duplicate { of: b }
        );
        // A representative in an exited process is stale too.
        mem.pages.remove(&b);
        let d = mem.set(4, 0, 9);
        assert_eq!(place(&mut index, &mut mem, d, sum, sum), Placement::Unique);
    }

    #[test]
    fn the_stable_tree_persists_and_bypasses_the_gate() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[3; PAGE]);
        let merged = mem.set(1, 0, 3);
        index.begin_pass();
        let content = mem.pages[&merged];
        assert_eq!(
            index.place(merged, sum, sum, true, Content::Loaded(&content), &mut mem),
            Placement::Unique
        );
        index.begin_pass();
        index.begin_pass();
        assert_eq!(index.classes().0, 1, "stable tree lost its content");
        // A page that changed since last pass still matches merged content.
        let fresh = mem.set(2, 0, 3);
        assert_eq!(
            place(
                &mut index,
                &mut mem,
                fresh,
                sum,
                crate::engine::checksum::NO_CHECKSUM
            ),
            Placement::Duplicate { of: merged }
        );
        assert_eq!(index.top(1)[0].pids, [1, 2]);
    }

    #[test]
    fn merged_content_seen_after_an_unmerged_copy_counts_once() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[4; PAGE]);
        let plain = mem.set(1, 0, 4);
        let merged = mem.set(2, 0, 4);
        index.begin_pass();
        assert_eq!(
            place(&mut index, &mut mem, plain, sum, sum),
            Placement::Unique
        );
        let content = mem.pages[&merged];
        assert_eq!(
            index.place(merged, sum, sum, true, Content::Loaded(&content), &mut mem),
            Placement::Duplicate { of: plain }
        );
    }

    #[test]
    fn unread_pages_are_read_only_when_a_comparison_needs_them() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::with_cache(kind, 0);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[5; PAGE]);
        let a = mem.set(1, 0, 5);
        let b = mem.set(2, 0, 5);
        index.begin_pass();
        assert_eq!(
            index.place(a, sum, sum, false, Content::Unread, &mut mem),
            Placement::Unique
        );
        assert_eq!(mem.reads, 0, "a unique clean page must not be read");
        assert_eq!(
            index.place(b, sum, sum, false, Content::Unread, &mut mem),
            Placement::Duplicate { of: a }
        );
        assert_eq!(
            mem.reads, 2,
            "one read of the representative, one of the page"
        );
        // A "clean" page whose content no longer has its checksum is not trusted.
        let c = mem.set(3, 0, 6);
        assert_eq!(
            index.place(c, sum, sum, false, Content::Unread, &mut mem),
            Placement::Vanished
        );
    }

    #[test]
    fn settled_pages_join_by_checksum_without_any_read() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::with_cache(kind, 0);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[5; PAGE]);
        let a = mem.set(1, 0, 5);
        index.begin_pass();
        let content = mem.pages[&a];
        assert_eq!(
            index.place(a, sum, sum, false, Content::Loaded(&content), &mut mem),
            Placement::Unique
        );
        let settled = PageRef { pid: 2, addr: 0 };
        assert_eq!(
            index.place(settled, sum, sum, false, Content::Settled, &mut mem),
            Placement::Duplicate { of: a }
        );
        assert_eq!(mem.reads, 0);
    }

    #[test]
    fn zero_pages_need_no_read_and_are_flagged() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let zero = kind.checksum(&[0; PAGE]);
        index.begin_pass();
        let first = PageRef { pid: 1, addr: 0 };
        let second = PageRef { pid: 2, addr: 0 };
        assert_eq!(
            index.place(first, zero, zero, false, Content::Zero, &mut mem),
            Placement::Unique
        );
        assert_eq!(
            index.place(second, zero, zero, false, Content::Zero, &mut mem),
            Placement::Duplicate { of: first }
        );
        assert_eq!(mem.reads, 0);
        assert!(index.top(1)[0].zero);
    }

    #[test]
    fn a_class_is_24_bytes() {
        assert_eq!(size_of::<Class>(), 24);
    }
}
