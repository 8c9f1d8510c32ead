//! The dedup index: KSM's stable and unstable trees, kept from pass to pass.
//!
//! KSM finds identical pages with two trees. The *unstable tree* holds pages whose checksum
//! did not change since the previous pass (the checksum gate); KSM rebuilds it from scratch on
//! every pass, because it cannot know which of its pages changed since they were inserted.
//! The *stable tree* holds contents that are already merged. rksm knows which pages changed:
//! the scan takes a page out of the index when the dirty source says it was written (or, in
//! hash-only mode, when it is hashed again), and puts it back once it has passed the gate. So
//! the index persists, and a page that stays clean costs nothing in it after its first
//! placement. A class is "stable" once one of its pages was a KSM page: a page with that
//! content is a duplicate even if it is new, as in KSM's stable tree.
//!
//! Each checksum leads to *content classes*: pages whose contents were compared equal, byte
//! for byte. A checksum only says where to look; a page joins a class only after its content
//! compares equal to the class's representative, so a collision (crc32c has one in ~78,000
//! random pages) costs a comparison, never a wrong answer. How contents and classes are laid
//! out in memory is [`classes`]'s.
//!
//! To compare, the index reads the representative's content from its process through a
//! [`ContentSource`] (a bounded cache keeps the ones compared again and again). A
//! representative that can no longer be read, or whose content no longer has its checksum,
//! leaves its class and is reported in [`Index::take_stale`], so that its owner hashes it
//! again: the index never holds a page under a checksum it is known not to have.

mod cache;
mod classes;

use std::collections::hash_map::Entry;

use rksm_common::PAGE;

use self::{
    cache::RepCache,
    classes::{Class, Classes, Single},
};
use crate::engine::{
    checksum::{ChecksumKind, PageChecksum},
    keys::KeyMap,
};

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
    /// Not read this pass (the dirty source says it is unchanged since it was hashed); read
    /// it only if a comparison needs it, and check it still has its checksum.
    Unread,
}

/// Where a page ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The only page with this content: it stays.
    Unique,
    /// Its content equals another page's (or a merged page's): merging would free it.
    Duplicate {
        /// The class's representative: marking both lets ksmd merge them.
        of: PageRef,
    },
    /// Its checksum changed since it was last hashed: kept out of the unstable tree.
    Volatile,
    /// Its content was needed for a comparison but could not be read.
    Vanished,
}

/// A most-duplicated content.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TopContent {
    /// Its checksum.
    pub checksum: u64,
    /// Pages holding it.
    pub copies: u32,
    /// Whether it is the all-zero page.
    pub zero: bool,
    /// Processes holding it.
    pub pids: Vec<u32>,
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
            Content::Unread => {
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

/// What comparing a page with a representative found.
enum Compared {
    Equal,
    Different,
    /// The page under test could not be read.
    PageGone,
    /// The representative no longer has its checksum: it left the index.
    RepresentativeGone,
}

/// Where a content was found.
enum Found {
    Single,
    /// The class in this slot.
    Class(u32),
}

enum Lookup {
    Found(Found),
    Missing,
    Vanished,
}

/// The classes of one merge domain, with KSM's rules for placing a page.
#[derive(Debug)]
pub struct Index {
    hash: PageChecksum,
    zero_checksum: u64,
    /// Contents held by one page (by far the most), each alone under its checksum.
    singles: KeyMap<Single>,
    /// Contents of several pages, and contents whose checksum another content has too.
    classes: Classes,
    cache: RepCache,
    /// Pages in the index.
    pages: u64,
    /// Classes in the index.
    contents: u64,
    /// Pages found changed or gone while comparing, taken out of the index.
    stale: Vec<PageRef>,
    scratch: Option<Box<[u8; PAGE]>>,
    /// The current round of [`Index::company_to_list`].
    release_round: u32,
}

/// Representatives kept in memory: 4096 pages, 16 MiB.
pub const DEFAULT_CACHE_PAGES: usize = 4096;

impl Index {
    /// An empty index for checksums of `kind`.
    pub fn new(kind: ChecksumKind) -> Self {
        Self::with_cache(kind, DEFAULT_CACHE_PAGES)
    }

    /// An empty index that keeps at most `cache_pages` representative contents.
    pub fn with_cache(kind: ChecksumKind, cache_pages: usize) -> Self {
        Self::with_checksum(kind.function(), cache_pages)
    }

    /// An empty index using any page checksum: tests force collisions with a weak one.
    pub fn with_checksum(hash: PageChecksum, cache_pages: usize) -> Self {
        Index {
            hash,
            zero_checksum: hash(&ZERO_PAGE),
            singles: KeyMap::default(),
            classes: Classes::default(),
            cache: RepCache::new(cache_pages),
            pages: 0,
            contents: 0,
            stale: Vec::new(),
            scratch: None,
            release_round: 0,
        }
    }

    /// Drops the representatives kept in memory (up to 16 MiB): between passes a page is
    /// compared rarely, and reading its representative then costs less than keeping them.
    pub fn release_cache(&mut self) {
        self.cache.clear();
    }

    /// Pages in the index and distinct contents among them.
    pub fn counts(&self) -> (u64, u64) {
        (self.pages, self.contents)
    }

    /// Pages found changed or unreadable while comparing since the last call: they left the
    /// index, and their owners must hash them again.
    pub fn take_stale(&mut self) -> Vec<PageRef> {
        std::mem::take(&mut self.stale)
    }

    /// Places one page, following KSM: a page equal to merged content (a stable class), or a
    /// merged page itself (`ksm`), is placed whatever the gate says; any other page must pass
    /// the checksum gate (`checksum == previous`) before it joins or starts a class.
    pub fn place(
        &mut self,
        page: PageRef,
        checksum: u64,
        previous: u64,
        ksm: bool,
        content: Content<'_>,
        src: &mut dyn ContentSource,
    ) -> Placement {
        let gate = ksm || checksum == previous;
        self.place_gated(page, checksum, gate, ksm, content, src).0
    }

    /// Places a page read for the first time in memory whose writes are tracked from now on,
    /// as if it had passed the gate: the dirty bit will say whether it stays unchanged until
    /// the next pass, and comparing it now, while its content is at hand, saves reading it
    /// again then. Returns where it went and whether a duplicate must still wait for the gate
    /// before it is marked (not for merged content or a KSM page, which KSM takes at once).
    pub fn place_first_read(
        &mut self,
        page: PageRef,
        checksum: u64,
        ksm: bool,
        content: Content<'_>,
        src: &mut dyn ContentSource,
    ) -> (Placement, bool) {
        let (placement, stable) = self.place_gated(page, checksum, true, ksm, content, src);
        (placement, !(stable || ksm))
    }

    /// Places a page read for the first time, as [`Index::place_first_read`] does, whose
    /// bytes the caller found equal to those of `twin`, a page placed this pass under
    /// `checksum`: it joins `twin`'s class without another comparison. If `twin` is no longer
    /// in the index under `checksum` (a comparison found it changed since), it is placed as
    /// any first read.
    pub fn place_twin(
        &mut self,
        page: PageRef,
        checksum: u64,
        twin: PageRef,
        ksm: bool,
        content: Content<'_>,
        src: &mut dyn ContentSource,
    ) -> (Placement, bool) {
        let found = match self.singles.get(&checksum) {
            Some(single) if single.page() == twin => Some(Found::Single),
            Some(_) => None,
            None => self
                .classes
                .slots(checksum)
                .find(|&slot| self.classes.get(slot).members.contains(twin))
                .map(Found::Class),
        };
        let Some(found) = found else {
            return self.place_first_read(page, checksum, ksm, content, src);
        };
        let (rep, stable) = match &found {
            Found::Single => (twin, self.singles[&checksum].stable),
            Found::Class(slot) => {
                let c = self.classes.get(*slot);
                (c.members.rep().unwrap_or(twin), c.stable)
            }
        };
        self.join(checksum, found, page, ksm);
        (Placement::Duplicate { of: rep }, !(stable || ksm))
    }

    /// Places a page, `gate` saying whether it passed the checksum gate; also says whether
    /// the class it joined holds merged content.
    fn place_gated(
        &mut self,
        page: PageRef,
        checksum: u64,
        gate: bool,
        ksm: bool,
        content: Content<'_>,
        src: &mut dyn ContentSource,
    ) -> (Placement, bool) {
        let mut under_test = PageUnderTest {
            page,
            content,
            loaded: None,
            vanished: false,
        };
        let placement = match self.find(checksum, &mut under_test, src) {
            Lookup::Vanished => Placement::Vanished,
            Lookup::Found(found) => {
                let (rep, stable) = match &found {
                    Found::Single => {
                        let s = self.singles[&checksum];
                        (s.page(), s.stable)
                    }
                    Found::Class(slot) => {
                        let c = self.classes.get(*slot);
                        (c.members.rep().unwrap_or(page), c.stable)
                    }
                };
                if !(gate || stable) {
                    return (Placement::Volatile, stable);
                }
                self.join(checksum, found, page, ksm);
                return (Placement::Duplicate { of: rep }, stable);
            }
            Lookup::Missing if !gate => Placement::Volatile,
            Lookup::Missing => {
                let zero = checksum == self.zero_checksum
                    && under_test
                        .content(src, self.hash, checksum)
                        .is_some_and(|c| c.iter().all(|&b| b == 0));
                if under_test.vanished {
                    return (Placement::Vanished, false);
                }
                self.insert(checksum, page, ksm, zero);
                Placement::Unique
            }
        };
        (placement, false)
    }

    /// Takes `page` (held under `checksum`) out of the index; false if it was not in it.
    pub fn remove(&mut self, page: PageRef, checksum: u64) -> bool {
        self.cache.forget(page);
        if let Entry::Occupied(e) = self.singles.entry(checksum) {
            if e.get().page() == page {
                e.remove();
                self.pages -= 1;
                self.contents -= 1;
                return true;
            }
            return false;
        }
        let Some(slot) = self
            .classes
            .slots(checksum)
            .find(|&slot| self.classes.get(slot).members.contains(page))
        else {
            return false;
        };
        let members = &mut self.classes.get_mut(slot).members;
        members.remove(page);
        self.pages -= 1;
        if members.len() == 0 {
            self.classes.take(checksum, slot);
            self.contents -= 1;
        }
        self.tidy(checksum);
        true
    }

    /// Keeps a checksum with one class of one page in `singles`.
    fn tidy(&mut self, checksum: u64) {
        let mut slots = self.classes.slots(checksum);
        let (Some(only), None) = (slots.next(), slots.next()) else {
            return;
        };
        drop(slots);
        if self.classes.get(only).members.len() != 1 {
            return;
        }
        let class = self.classes.take(checksum, only);
        if let Some(page) = class.members.rep() {
            self.singles
                .insert(checksum, Single::new(page, class.stable, class.zero));
        }
    }

    fn insert(&mut self, checksum: u64, page: PageRef, stable: bool, zero: bool) {
        self.pages += 1;
        self.contents += 1;
        let single = Single::new(page, stable, zero);
        if let Some(old) = self.singles.remove(&checksum) {
            self.classes.add(checksum, old.class());
            self.classes.add(checksum, single.class());
        } else if self.classes.holds(checksum) {
            self.classes.add(checksum, single.class());
        } else {
            self.singles.insert(checksum, single);
        }
    }

    fn join(&mut self, checksum: u64, found: Found, page: PageRef, ksm: bool) {
        self.pages += 1;
        match found {
            Found::Single => {
                if let Some(single) = self.singles.remove(&checksum) {
                    let mut class = single.class();
                    class.members.add(page);
                    class.stable |= ksm;
                    self.classes.add(checksum, class);
                }
            }
            Found::Class(slot) => {
                let class = self.classes.get_mut(slot);
                class.members.add(page);
                class.stable |= ksm;
            }
        }
    }

    /// Compares the page under test with representative `rep` (held under `checksum`), in
    /// place: the zero page, a cached content, or `rep` read into `buf` now. A representative
    /// that no longer has `checksum` (changed, unmapped, exited) leaves the index and is
    /// reported stale; one compared equal is cached for the next copies.
    fn compare_with(
        &mut self,
        rep: PageRef,
        zero: bool,
        checksum: u64,
        page: &mut PageUnderTest<'_>,
        src: &mut dyn ContentSource,
        buf: &mut [u8; PAGE],
    ) -> Compared {
        let cached = zero || self.cache.contains(&rep);
        if !(cached || src.read(rep, buf) && (self.hash)(&buf[..]) == checksum) {
            self.remove(rep, checksum);
            self.stale.push(rep);
            return Compared::RepresentativeGone;
        }
        let Some(mine) = page.content(src, self.hash, checksum) else {
            return Compared::PageGone;
        };
        let theirs: &[u8] = match self.cache.get(&rep) {
            _ if zero => &ZERO_PAGE,
            Some(content) => &content[..],
            None => &buf[..],
        };
        if mine != theirs {
            return Compared::Different;
        }
        if !cached {
            self.cache.insert(rep, buf);
        }
        Compared::Equal
    }

    /// Finds the class whose content equals the page's, comparing contents. Pages of the
    /// class that turn out changed or gone leave it (see [`Index::take_stale`]).
    fn find(
        &mut self,
        checksum: u64,
        page: &mut PageUnderTest<'_>,
        src: &mut dyn ContentSource,
    ) -> Lookup {
        // One page of scratch space, kept between calls: a placement allocates nothing.
        let mut buf = self.scratch.take().unwrap_or_else(|| Box::new([0u8; PAGE]));
        let found = self.find_with(checksum, page, src, &mut buf);
        self.scratch = Some(buf);
        found
    }

    fn find_with(
        &mut self,
        checksum: u64,
        page: &mut PageUnderTest<'_>,
        src: &mut dyn ContentSource,
        buf: &mut [u8; PAGE],
    ) -> Lookup {
        // Each time a representative is found stale, one page has left and the checksum's
        // classes are looked at again from the first: its class's next page stands for it,
        // or the class went, or the checksum moved to `singles`. So this ends.
        'again: loop {
            if let Some(single) = self.singles.get(&checksum).copied() {
                return match self.compare_with(single.page(), single.zero, checksum, page, src, buf)
                {
                    Compared::Equal => Lookup::Found(Found::Single),
                    Compared::PageGone => Lookup::Vanished,
                    Compared::Different | Compared::RepresentativeGone => Lookup::Missing,
                };
            }
            let mut rank = 0;
            while let Some(slot) = self.classes.nth(checksum, rank) {
                rank += 1;
                let class = self.classes.get(slot);
                let zero = class.zero;
                let Some(rep) = class.members.rep() else {
                    continue;
                };
                match self.compare_with(rep, zero, checksum, page, src, buf) {
                    Compared::Equal => return Lookup::Found(Found::Class(slot)),
                    Compared::PageGone => return Lookup::Vanished,
                    Compared::Different => {}
                    Compared::RepresentativeGone => continue 'again,
                }
            }
            return Lookup::Missing;
        }
    }

    /// The representative a page with `checksum` would be compared with first, if one is
    /// needed: none for a checksum the index does not hold, for the zero page, or for a
    /// representative whose content is cached already. A caller that reads many pages can
    /// read these in one go and hand them over with [`Index::preload`].
    pub fn representative_to_read(&self, checksum: u64) -> Option<PageRef> {
        let (rep, zero) = match self.singles.get(&checksum) {
            Some(single) => (single.page(), single.zero),
            None => {
                let class = self.classes.get(self.classes.slots(checksum).next()?);
                (class.members.rep()?, class.zero)
            }
        };
        (!zero && !self.cache.contains(&rep)).then_some(rep)
    }

    /// Another page of the class `page` is in under `checksum` (its representative if that
    /// is not `page`), or `None` if `page` is not in the index under `checksum` or is alone
    /// in its class: what [`Index::company_to_list`] finds, without its round. No content is
    /// read: pages leave the index when they are written.
    #[cfg(test)]
    fn company(&self, page: PageRef, checksum: u64) -> Option<PageRef> {
        let at = self.class_with_company(page, checksum)?;
        self.classes.get(at).members.company_of(page)
    }

    /// The slot of the class `page` is in under `checksum`, if it has other pages.
    fn class_with_company(&self, page: PageRef, checksum: u64) -> Option<u32> {
        self.classes.slots(checksum).find(|&at| {
            let members = &self.classes.get(at).members;
            members.len() > 1 && members.contains(page)
        })
    }

    /// Begins a round of [`Index::company_to_list`]: a pass's release of its held pages.
    pub fn begin_release(&mut self) {
        self.release_round = self.release_round.wrapping_add(1).max(1);
    }

    /// What a held page lets through the gate lists with itself as merge candidates, in the
    /// round begun last ([`Index::begin_release`]): `None` if it is not in the index under
    /// `checksum` or is alone in its class; else another page of its class (its
    /// representative if that is not `page`), but for a representative listed already in
    /// this round, as a page itself or as another's company (`Some(None)`). No content is
    /// read: pages leave the index when they are written. A content held
    /// in four processes then lists its representative once, not four times; the pages
    /// listed are the same.
    pub fn company_to_list(&mut self, page: PageRef, checksum: u64) -> Option<Option<PageRef>> {
        let at = self.class_with_company(page, checksum)?;
        let round = self.release_round;
        let class = self.classes.get_mut(at);
        let listed = std::mem::replace(&mut class.listed, round) == round;
        let rep = class.members.rep();
        Some(
            class
                .members
                .company_of(page)
                .filter(|&other| !(listed && Some(other) == rep)),
        )
    }

    /// Fetches where [`Index::company_to_list`] looks `checksum` up first: lookups of unrelated
    /// checksums in a row each wait for memory otherwise.
    pub fn prefetch_company(&self, checksum: u64) {
        self.classes.prefetch(checksum);
    }

    /// Whether a page with `checksum` will be compared with a page of the index.
    pub fn holds(&self, checksum: u64) -> bool {
        self.singles.contains_key(&checksum) || self.classes.holds(checksum)
    }

    /// Keeps `content`, read just now, as representative `rep`'s, if it still has `checksum`
    /// (otherwise the comparison reads it again, and finds it stale).
    pub fn preload(&mut self, rep: PageRef, checksum: u64, content: &[u8]) {
        if let Ok(page) = <&[u8; PAGE]>::try_from(content) {
            if (self.hash)(page) == checksum {
                self.preload_hashed(rep, page);
            }
        }
    }

    /// Keeps `content` as representative `rep`'s, with no check: the caller read it this pass
    /// and hashed these very bytes to the checksum the index holds `rep` under.
    pub fn preload_hashed(&mut self, rep: PageRef, content: &[u8; PAGE]) {
        self.cache.insert(rep, content);
    }

    /// The `n` contents with the most copies, most first.
    pub fn top(&self, n: usize) -> Vec<TopContent> {
        let mut all: Vec<(u64, &Class)> = self
            .classes
            .iter()
            .filter(|(_, c)| c.members.len() > 1)
            .collect();
        all.sort_unstable_by(|a, b| {
            b.1.members
                .len()
                .cmp(&a.1.members.len())
                .then(a.0.cmp(&b.0))
        });
        all.truncate(n);
        all.into_iter()
            .map(|(checksum, class)| {
                let mut pids: Vec<u32> = class.members.iter().map(|p| p.pid).collect();
                pids.sort_unstable();
                pids.dedup();
                TopContent {
                    checksum,
                    copies: class.members.len() as u32,
                    zero: class.zero,
                    pids,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::checksum::NO_CHECKSUM;
    use std::collections::HashMap;

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
                addr: index * rksm_common::PAGE_SIZE,
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
    fn a_representative_read_ahead_spares_the_comparison_its_read() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let (rep, other) = (mem.set(1, 0, 7), mem.set(2, 0, 7));
        let sum = kind.checksum(&[7; PAGE]);
        assert_eq!(
            index.representative_to_read(sum),
            None,
            "nothing to compare with yet"
        );
        assert_eq!(
            place(&mut index, &mut mem, rep, sum, sum),
            Placement::Unique
        );
        assert!(index.holds(sum));
        assert_eq!(index.representative_to_read(sum), Some(rep));
        // Content that no longer has the checksum is not kept: the comparison reads it.
        index.preload(rep, sum, &[8; PAGE]);
        assert_eq!(index.representative_to_read(sum), Some(rep));
        index.preload(rep, sum, &[7; PAGE]);
        assert_eq!(index.representative_to_read(sum), None, "cached");
        let reads = mem.reads;
        assert_eq!(
            place(&mut index, &mut mem, other, sum, sum),
            Placement::Duplicate { of: rep }
        );
        assert_eq!(mem.reads, reads, "compared with the preloaded content");
    }

    #[test]
    fn the_gate_keeps_changed_pages_out() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let a = mem.set(1, 0, 7);
        let b = mem.set(2, 0, 7);
        let sum = kind.checksum(&[7; PAGE]);
        // Hashed for the first time: nothing enters.
        assert_eq!(
            place(&mut index, &mut mem, a, sum, NO_CHECKSUM),
            Placement::Volatile
        );
        assert_eq!(
            place(&mut index, &mut mem, b, sum, NO_CHECKSUM),
            Placement::Volatile
        );
        assert_eq!(index.counts(), (0, 0));
        // Unchanged since: they meet.
        assert_eq!(place(&mut index, &mut mem, a, sum, sum), Placement::Unique);
        assert_eq!(
            place(&mut index, &mut mem, b, sum, sum),
            Placement::Duplicate { of: a }
        );
        assert_eq!(index.counts(), (2, 1));
        // A page that changed since its previous checksum stays out even if it now matches.
        let c = mem.set(3, 0, 7);
        assert_eq!(
            place(&mut index, &mut mem, c, sum, sum ^ 1),
            Placement::Volatile
        );
    }

    #[test]
    fn pages_stay_until_they_are_taken_out() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[1; PAGE]);
        let a = mem.set(1, 0, 1);
        let b = mem.set(2, 0, 1);
        assert_eq!(place(&mut index, &mut mem, a, sum, sum), Placement::Unique);
        // Still there a pass later: nothing is rebuilt.
        assert_eq!(
            place(&mut index, &mut mem, b, sum, sum),
            Placement::Duplicate { of: a }
        );
        // a is written: it leaves, and b stands for the content.
        assert!(index.remove(a, sum));
        assert!(!index.remove(a, sum), "removed twice");
        assert_eq!(index.counts(), (1, 1));
        let c = mem.set(3, 0, 1);
        assert_eq!(
            place(&mut index, &mut mem, c, sum, sum),
            Placement::Duplicate { of: b }
        );
        assert!(index.remove(b, sum) && index.remove(c, sum));
        assert_eq!(index.counts(), (0, 0));
        assert!(index.singles.is_empty() && index.classes.is_empty());
    }

    #[test]
    fn a_large_class_is_left_in_constant_time_and_keeps_a_representative() {
        let mut index = Index::with_checksum(|_| WEAK, 0);
        let mut mem = Memory::default();
        let pages: Vec<PageRef> = (0..1000).map(|i| mem.set(1, i, 3)).collect();
        for &p in &pages {
            place(&mut index, &mut mem, p, WEAK, WEAK);
        }
        assert_eq!(index.counts(), (1000, 1));
        assert!(matches!(
            index.classes.iter().next().map(|(_, class)| &class.members),
            Some(classes::Members::Many(_))
        ));
        for &p in &pages[..999] {
            assert!(index.remove(p, WEAK));
        }
        let late = mem.set(2, 0, 3);
        assert_eq!(
            place(&mut index, &mut mem, late, WEAK, WEAK),
            Placement::Duplicate { of: pages[999] }
        );
    }

    #[test]
    fn collisions_are_decided_by_content() {
        // Every page collides with every other under this checksum.
        let mut index = Index::with_checksum(|_| WEAK, 0);
        let mut mem = Memory::default();
        let pages: Vec<PageRef> = (0..6).map(|i| mem.set(1, i, (i % 3) as u8 + 1)).collect();
        let placed: Vec<Placement> = pages
            .iter()
            .map(|&p| place(&mut index, &mut mem, p, WEAK, WEAK))
            .collect();
        use Placement::*;
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
        assert_eq!(index.counts(), (6, 3));
        let top = index.top(10);
        assert_eq!(top.len(), 3);
        assert!(top.iter().all(|t| t.copies == 2 && t.checksum == WEAK));
    }

    #[test]
    fn a_representative_that_changed_leaves_and_is_reported() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::with_cache(kind, 0);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[9; PAGE]);
        let a = mem.set(1, 0, 9);
        assert_eq!(place(&mut index, &mut mem, a, sum, sum), Placement::Unique);
        mem.set(1, 0, 8); // a is rewritten and nobody said so
        let b = mem.set(2, 0, 9);
        // b's content equals a's *old* content: a leaves, b starts a new class.
        assert_eq!(place(&mut index, &mut mem, b, sum, sum), Placement::Unique);
        assert_eq!(index.take_stale(), [a]);
        assert_eq!(index.counts(), (1, 1));
        let c = mem.set(3, 0, 9);
        assert_eq!(
            place(&mut index, &mut mem, c, sum, sum),
            Placement::Duplicate { of: b }
        );
        // A representative in an exited process leaves too; the next page stands for it.
        mem.pages.remove(&b);
        let d = mem.set(4, 0, 9);
        assert_eq!(
            place(&mut index, &mut mem, d, sum, sum),
            Placement::Duplicate { of: c }
        );
        assert_eq!(index.take_stale(), [b]);
    }

    #[test]
    fn a_class_whose_pages_all_went_is_left_page_by_page_in_a_loop() {
        // A process with 20,000 copies of one content exits: the next page with that content
        // meets each of them stale, one after another, without a frame per page.
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::with_cache(kind, 0);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[5; PAGE]);
        let gone: Vec<PageRef> = (0..20_000).map(|i| mem.set(1, i, 5)).collect();
        for &p in &gone {
            place(&mut index, &mut mem, p, sum, sum);
        }
        assert_eq!(index.counts(), (20_000, 1));
        mem.pages.clear();
        let late = mem.set(2, 0, 5);
        assert_eq!(
            place(&mut index, &mut mem, late, sum, sum),
            Placement::Unique
        );
        assert_eq!(index.take_stale().len(), 20_000);
        assert_eq!(index.counts(), (1, 1));
    }

    #[test]
    fn merged_content_bypasses_the_gate() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[3; PAGE]);
        let merged = mem.set(1, 0, 3);
        let content = mem.pages[&merged];
        assert_eq!(
            index.place(
                merged,
                sum,
                NO_CHECKSUM,
                true,
                Content::Loaded(&content),
                &mut mem
            ),
            Placement::Unique
        );
        // A page that changed since last pass still matches merged content.
        let fresh = mem.set(2, 0, 3);
        assert_eq!(
            place(&mut index, &mut mem, fresh, sum, NO_CHECKSUM),
            Placement::Duplicate { of: merged }
        );
        assert_eq!(index.top(1)[0].pids, [1, 2]);
    }

    #[test]
    fn a_round_of_releases_lists_a_representative_once() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[6; PAGE]);
        let pages: Vec<PageRef> = (1..=4).map(|pid| mem.set(pid, 0, 6)).collect();
        let (a, b, c, d) = (pages[0], pages[1], pages[2], pages[3]);
        for &page in &pages {
            let content = mem.pages[&page];
            index.place_first_read(page, sum, false, Content::Loaded(&content), &mut mem);
        }
        index.begin_release();
        // The representative's company is listed with it; then the others list only
        // themselves, the representative being listed.
        assert_eq!(index.company_to_list(a, sum), Some(Some(b)));
        assert_eq!(index.company_to_list(b, sum), Some(None));
        assert_eq!(index.company_to_list(d, sum), Some(None));
        index.begin_release();
        // Another round, another order: the first lists the representative, which, released
        // after, still lists its own company.
        assert_eq!(index.company_to_list(c, sum), Some(Some(a)));
        assert_eq!(index.company_to_list(d, sum), Some(None));
        assert_eq!(index.company_to_list(a, sum), Some(Some(b)));
        // A page without company lists nothing, and is not let through.
        let lone = mem.set(5, 0, 7);
        let content = mem.pages[&lone];
        let lone_sum = kind.checksum(&[7; PAGE]);
        index.place_first_read(lone, lone_sum, false, Content::Loaded(&content), &mut mem);
        assert_eq!(index.company_to_list(lone, lone_sum), None);
    }

    #[test]
    fn a_first_read_is_placed_at_once_and_says_whether_its_duplicate_waits_for_the_gate() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let sum = kind.checksum(&[4; PAGE]);
        let (a, b) = (mem.set(1, 0, 4), mem.set(2, 0, 4));
        let content = mem.pages[&a];
        let first = |index: &mut Index, mem: &mut Memory, page, ksm| {
            index.place_first_read(page, sum, ksm, Content::Loaded(&content), mem)
        };
        assert_eq!(
            first(&mut index, &mut mem, a, false),
            (Placement::Unique, true)
        );
        assert_eq!(index.company(a, sum), None, "alone in its class");
        assert_eq!(
            first(&mut index, &mut mem, b, false),
            (Placement::Duplicate { of: a }, true)
        );
        assert_eq!(
            (index.company(a, sum), index.company(b, sum)),
            (Some(b), Some(a))
        );
        // Company is asked of the index only: a page that left has none, nor its copy.
        assert!(index.remove(b, sum));
        assert_eq!((index.company(a, sum), index.company(b, sum)), (None, None));
        // Merged content takes a copy at once, as KSM's stable tree does.
        let merged = mem.set(3, 0, 4);
        assert_eq!(
            first(&mut index, &mut mem, merged, true),
            (Placement::Duplicate { of: a }, false)
        );
        let c = mem.set(4, 0, 4);
        assert_eq!(
            first(&mut index, &mut mem, c, false),
            (Placement::Duplicate { of: a }, false)
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
    fn zero_pages_need_no_read_and_are_flagged() {
        let kind = ChecksumKind::Xxh64;
        let mut index = Index::new(kind);
        let mut mem = Memory::default();
        let zero = kind.checksum(&[0; PAGE]);
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
}
