//! /proc/PID/pagemap and /proc/kpageflags: which pages are present, written, and mapped to
//! which frames, and what those frames are (KSM pages, zero pages, huge pages). The only
//! place that knows their bit layouts, and PAGEMAP_SCAN's.

use std::{
    collections::HashSet,
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd},
        unix::fs::FileExt,
    },
    path::PathBuf,
};

use rksm_common::{PAGE, PAGE_SIZE};

use super::{io_error, ProcfsError};
use crate::kernel::ranges::{page_runs, Range};

/// PAGEMAP_SCAN (Linux 6.7): the pages of a range by category, one region per run.
pub(crate) const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub(crate) const PAGE_IS_PRESENT: u64 = 1 << 3;

/// `struct page_region`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

nix::ioctl_readwrite!(pagemap_scan, b'f', 16, PmScanArg);

/// `PM_SCAN_WP_MATCHING`: write-protect the pages that match, atomically with the report.
pub(crate) const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// `PM_SCAN_CHECK_WPASYNC`: fail unless the range is registered for async write protection.
pub(crate) const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

/// One kind of PAGEMAP_SCAN query: its flags and the categories it matches and returns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageScan {
    pub flags: u64,
    pub category_mask: u64,
    pub return_mask: u64,
}

impl PageScan {
    /// Walks `start..end` of the pagemap `fd`, calling `found` for every matching region,
    /// and going on from where the kernel stopped when its vector of regions filled up.
    pub fn walk(
        self,
        fd: BorrowedFd<'_>,
        start: u64,
        end: u64,
        found: &mut dyn FnMut(&PageRegion),
    ) -> Result<(), nix::errno::Errno> {
        let mut regions = [PageRegion::default(); 256];
        let mut from = start;
        while from < end {
            let mut arg = PmScanArg {
                size: size_of::<PmScanArg>() as u64,
                flags: self.flags,
                start: from,
                end,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                category_mask: self.category_mask,
                return_mask: self.return_mask,
                ..PmScanArg::default()
            };
            // SAFETY: `arg` describes `regions`, which outlives the call; the kernel writes at
            // most vec_len entries into it and reads nothing else of ours.
            let n = unsafe { pagemap_scan(fd.as_raw_fd(), &mut arg) }?;
            for region in &regions[..n as usize] {
                found(region);
            }
            from = if arg.walk_end > from {
                arg.walk_end
            } else {
                end
            };
        }
        Ok(())
    }
}

impl PageScan {
    /// Write-protects `start..end` of the pagemap `fd` (flags [`PM_SCAN_WP_MATCHING`]) and
    /// lists nothing: without a vector of regions to fill, the kernel protects every page
    /// of a page table in one loop over its entries.
    pub fn protect(
        self,
        fd: BorrowedFd<'_>,
        start: u64,
        end: u64,
    ) -> Result<(), nix::errno::Errno> {
        let mut arg = PmScanArg {
            size: size_of::<PmScanArg>() as u64,
            flags: self.flags,
            start,
            end,
            category_mask: self.category_mask,
            return_mask: self.return_mask,
            ..PmScanArg::default()
        };
        // SAFETY: `arg` names no vector (vec_len 0): the kernel writes nothing of ours but
        // `arg` itself.
        unsafe { pagemap_scan(fd.as_raw_fd(), &mut arg) }.map(|_| ())
    }
}

/// Those of `pages` (of `pid`, sorted) mapped to KSM pages: one pagemap read per run of
/// consecutive pages, one kpageflags read per page mapped more than once.
pub fn ksm_mapped(pid: u32, pages: &[u64]) -> HashSet<u64> {
    mapped_where(pid, pages, |_, entry, flags| {
        !entry.exclusive() && flags().is_some_and(PageFlags::ksm)
    })
}

/// Those of `pages` (of `pid`, sorted) mapped to KSM pages, and those mapped to the zero
/// page.
pub fn ksm_or_zero_mapped(pid: u32, pages: &[u64]) -> (HashSet<u64>, HashSet<u64>) {
    let mut zero = HashSet::new();
    let ksm = mapped_where(pid, pages, |page, entry, flags| {
        if entry.exclusive() {
            return false;
        }
        let flags = flags().unwrap_or_default();
        if flags.zero_page() {
            zero.insert(page);
        }
        flags.ksm()
    });
    (ksm, zero)
}

/// Those of `pages` (of `pid`, sorted) that are part of a transparent huge page.
pub fn thp_mapped(pid: u32, pages: &[u64]) -> HashSet<u64> {
    mapped_where(pid, pages, |_, _, flags| {
        flags().is_some_and(PageFlags::thp)
    })
}

/// Those of `pages` (sorted) present in `pid` whose entry and frame flags satisfy `keep`
/// (which reads kpageflags only if it asks): one pagemap read per run of pages.
fn mapped_where(
    pid: u32,
    pages: &[u64],
    mut keep: impl FnMut(u64, PagemapEntry, &dyn Fn() -> Option<PageFlags>) -> bool,
) -> HashSet<u64> {
    let mut mapped = HashSet::new();
    let (Ok(pagemap), Ok(flags)) = (Pagemap::open(pid), KpageFlags::open()) else {
        return mapped;
    };
    let mut entries = vec![PagemapEntry(0); 512];
    for run in page_runs(pages, entries.len()) {
        let Ok(got) = pagemap.read(run[0], &mut entries[..run.len()]) else {
            break;
        };
        for (&page, &entry) in run.iter().zip(&entries[..got]) {
            let Some(pfn) = entry.pfn() else {
                continue;
            };
            if keep(page, entry, &|| flags.get(pfn).ok()) {
                mapped.insert(page);
            }
        }
    }
    mapped
}

/// Whether /proc/kpageflags tells KSM pages apart: a page of rksm's own, anonymous and
/// written, must not show `KPF_KSM`. Some kernels set it on every anonymous page (Debian
/// 12's 6.12.117 package does); there rksm can tell a merged frame only by its being mapped
/// more than once, which a frame shared by fork is too.
pub fn ksm_flag_reliable() -> bool {
    static RELIABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *RELIABLE.get_or_init(|| {
        let mut page = vec![0u8; 2 * PAGE];
        let addr = (page.as_mut_ptr() as u64).next_multiple_of(PAGE_SIZE);
        // SAFETY: inside the vector, which lives until the end of this closure.
        unsafe { (addr as *mut u8).write_volatile(1) };
        let mut entry = [PagemapEntry(0)];
        let flags = Pagemap::open(std::process::id())
            .and_then(|pagemap| pagemap.read(addr, &mut entry))
            .ok()
            .and_then(|_| entry[0].pfn())
            .and_then(|pfn| KpageFlags::open().ok()?.get(pfn).ok());
        std::hint::black_box(&page);
        flags.is_none_or(|f| !f.ksm())
    })
}

/// Whether the host may give anonymous memory transparent huge pages (its setting is not
/// `never`).
pub fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

/// One 64-bit entry of /proc/PID/pagemap (Documentation/admin-guide/mm/pagemap.rst).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct PagemapEntry(pub u64);

impl PagemapEntry {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const FILE_OR_SHARED_ANON: u64 = 1 << 61;
    const UFFD_WP: u64 = 1 << 57;
    const SOFT_DIRTY: u64 = 1 << 55;
    const EXCLUSIVE: u64 = 1 << 56;
    const PFN_MASK: u64 = (1 << 55) - 1;

    /// The page is in RAM.
    pub fn present(self) -> bool {
        self.0 & Self::PRESENT != 0
    }
    /// The page is in swap.
    pub fn swapped(self) -> bool {
        self.0 & Self::SWAPPED != 0
    }
    /// The page is file-backed or shared anonymous (not something rksm scans).
    pub fn file_or_shared(self) -> bool {
        self.0 & Self::FILE_OR_SHARED_ANON != 0
    }
    /// The PTE is userfaultfd write-protected.
    pub fn uffd_wp(self) -> bool {
        self.0 & Self::UFFD_WP != 0
    }
    /// Written since the last clear of the process's soft-dirty bits, or in a VMA created
    /// or grown since (always clear without `CONFIG_MEM_SOFT_DIRTY`).
    pub fn soft_dirty(self) -> bool {
        self.0 & Self::SOFT_DIRTY != 0
    }
    /// The page is mapped exactly once (by this PTE): nobody shares it.
    pub fn exclusive(self) -> bool {
        self.0 & Self::EXCLUSIVE != 0
    }
    /// The page frame number, if present (zero without CAP_SYS_ADMIN).
    pub fn pfn(self) -> Option<u64> {
        (self.present() && !self.swapped()).then_some(self.0 & Self::PFN_MASK)
    }
}

/// An open /proc/PID/pagemap.
#[derive(Debug)]
pub struct Pagemap {
    pid: u32,
    path: PathBuf,
    file: File,
}

impl Pagemap {
    /// Opens the pagemap of `pid`.
    pub fn open(pid: u32) -> Result<Self, ProcfsError> {
        let path = PathBuf::from(format!("/proc/{pid}/pagemap"));
        let file = File::open(&path).map_err(|e| io_error(pid, path.clone(), e))?;
        Ok(Pagemap { pid, path, file })
    }

    /// The runs of present pages in `start..end`, from the kernel's page-table walk: a
    /// sparse mapping (a 1 TiB arena with a few pages touched) costs what its present pages
    /// cost, not one pagemap entry per virtual page. Without PAGEMAP_SCAN (before Linux
    /// 6.7), the whole range, to be read entry by entry.
    pub fn present_runs(&self, start: u64, end: u64) -> Result<Vec<Range>, ProcfsError> {
        let mut runs = Vec::new();
        let scan = PageScan {
            flags: 0,
            category_mask: PAGE_IS_PRESENT,
            return_mask: PAGE_IS_PRESENT,
        };
        match scan.walk(self.file.as_fd(), start, end, &mut |r| {
            runs.push(Range::new(r.start, r.end))
        }) {
            Ok(()) => Ok(runs),
            Err(nix::errno::Errno::ENOTTY | nix::errno::Errno::EINVAL) if runs.is_empty() => {
                Ok(vec![Range::new(start, end)])
            }
            Err(e) => Err(io_error(self.pid, self.path.clone(), e.into())),
        }
    }

    /// Fills `entries` with the entries of the pages starting at `start`; returns how many
    /// were read (fewer near the end of the address space).
    pub fn read(&self, start: u64, entries: &mut [PagemapEntry]) -> Result<usize, ProcfsError> {
        let len = std::mem::size_of_val(entries);
        // SAFETY: the view covers exactly the entries' memory, borrowed mutably for as long as
        // it lives, and an entry is a transparent u64 in the kernel's byte order, which any
        // bytes are.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(entries.as_mut_ptr().cast::<u8>(), len) };
        let offset = start / PAGE_SIZE * 8;
        let mut filled = 0;
        while filled < bytes.len() {
            match self
                .file
                .read_at(&mut bytes[filled..], offset + filled as u64)
            {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error(self.pid, self.path.clone(), e)),
            }
        }
        Ok(filled / 8)
    }
}

/// Flags of one physical page from /proc/kpageflags (include/uapi/linux/kernel-page-flags.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageFlags(pub u64);

impl PageFlags {
    const KSM: u64 = 1 << 21;
    const THP: u64 = 1 << 22;
    const ZERO_PAGE: u64 = 1 << 24;

    /// A KSM page: already merged.
    pub fn ksm(self) -> bool {
        self.0 & Self::KSM != 0
    }
    /// Part of a transparent huge page.
    pub fn thp(self) -> bool {
        self.0 & Self::THP != 0
    }
    /// The shared zero page (or huge zero page).
    pub fn zero_page(self) -> bool {
        self.0 & Self::ZERO_PAGE != 0
    }
}

/// An open /proc/kpageflags (root only).
pub struct KpageFlags {
    file: File,
}

impl KpageFlags {
    const PATH: &'static str = "/proc/kpageflags";

    /// Opens /proc/kpageflags.
    pub fn open() -> Result<Self, ProcfsError> {
        let file = File::open(Self::PATH).map_err(|source| ProcfsError::Io {
            path: Self::PATH.into(),
            source,
        })?;
        Ok(KpageFlags { file })
    }

    /// The flags of page frame `pfn`.
    pub fn get(&self, pfn: u64) -> Result<PageFlags, ProcfsError> {
        let mut raw = [0u8; 8];
        self.file
            .read_exact_at(&mut raw, pfn * 8)
            .map_err(|source| ProcfsError::Io {
                path: Self::PATH.into(),
                source,
            })?;
        Ok(PageFlags(u64::from_ne_bytes(raw)))
    }
}
