//! Dirty sources: which pages must be hashed again this pass.
//!
//! This is where rksm differs from KSM. KSM rehashes every candidate on every pass because it
//! has no other way to know a page is unchanged. A dirty source answers that question per
//! process: "every page" (hash-only, KSM's rule), or "these pages, and no others" when it can
//! prove the others clean (the eBPF tracer or PAGEMAP_SCAN after write-protecting, in later
//! modules). The scanner treats a page as clean only when the source says so *and* it has a
//! checksum from a previous pass; the index still compares contents before anything counts.

use std::collections::HashSet;

use crate::procfs::Vma;

/// The pages a source says were written since the previous pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirtySet {
    /// Treat every page as written (hash-only mode, or the source lost track).
    All,
    /// Only these page addresses were written; every other page is provably clean.
    Only(HashSet<u64>),
}

impl DirtySet {
    /// Whether `page` must be hashed again.
    pub fn contains(&self, page: u64) -> bool {
        match self {
            DirtySet::All => true,
            DirtySet::Only(pages) => pages.contains(&page),
        }
    }
}

/// Errors a dirty source can hit (arming or reading write state).
#[derive(Debug, thiserror::Error)]
#[error("dirty source {source_name} on pid {pid}: {message}")]
pub struct DirtyError {
    /// The source's mode name.
    pub source_name: &'static str,
    /// The process.
    pub pid: u32,
    /// What went wrong.
    pub message: String,
}

/// Decides, per process and pass, which pages must be rehashed.
pub trait DirtySource {
    /// The mode's name as the command line spells it (`hash-only`, `ebpf`, `pagemap`).
    fn mode(&self) -> &'static str;

    /// The pages of `pid` (within its scanned `vmas`) written since the previous call for
    /// the same process. The first call for a process must return [`DirtySet::All`].
    fn dirty_pages(&mut self, pid: u32, vmas: &[Vma]) -> Result<DirtySet, DirtyError>;

    /// `pid` is gone: drop whatever is kept for it.
    fn forget(&mut self, pid: u32);
}

/// KSM's rule: every candidate is rehashed every pass.
#[derive(Debug, Default, Clone, Copy)]
pub struct HashOnly;

impl DirtySource for HashOnly {
    fn mode(&self) -> &'static str {
        "hash-only"
    }

    fn dirty_pages(&mut self, _pid: u32, _vmas: &[Vma]) -> Result<DirtySet, DirtyError> {
        Ok(DirtySet::All)
    }

    fn forget(&mut self, _pid: u32) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_only_marks_everything_dirty_every_time() {
        let mut source = HashOnly;
        for _ in 0..3 {
            let dirty = source.dirty_pages(1, &[]).unwrap();
            assert!(dirty.contains(0x1000) && dirty.contains(0xdead_0000));
        }
        assert_eq!(source.mode(), "hash-only");
    }

    #[test]
    fn only_contains_exactly_its_pages() {
        let dirty = DirtySet::Only([0x1000, 0x3000].into_iter().collect());
        assert!(dirty.contains(0x1000) && dirty.contains(0x3000));
        assert!(!dirty.contains(0x2000));
    }
}
