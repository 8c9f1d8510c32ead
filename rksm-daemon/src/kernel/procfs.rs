//! /proc parsing, in one place: maps, pagemap, kpageflags.
//!
//! rksm decides what to read, what is already shared and what is a KSM or zero page entirely
//! from what the kernel reports in /proc. Each file has its own format and its own way of
//! failing when a process exits or unmaps memory mid-read; this module turns all of that into
//! plain values and typed errors, and is the only place that knows the bit layouts.

use std::{
    collections::HashSet,
    fs::File,
    io::{self, BufRead, BufReader},
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd},
        unix::fs::FileExt,
    },
    path::PathBuf,
};

use rksm_common::{PAGE, PAGE_SIZE};

use crate::kernel::ranges::{page_runs, Range};

/// PAGEMAP_SCAN (Linux 6.7): the pages of a range by category, one region per run.
pub(crate) const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub(crate) const PAGE_IS_PRESENT: u64 = 1 << 3;
pub(crate) const PAGE_IS_PFNZERO: u64 = 1 << 5;

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

/// Errors reading /proc.
#[derive(Debug, thiserror::Error)]
pub enum ProcfsError {
    /// The process is gone (or never existed).
    #[error("process {0} has exited")]
    Gone(u32),
    /// A /proc file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

fn io_error(pid: u32, path: PathBuf, source: io::Error) -> ProcfsError {
    // ESRCH comes back from pagemap reads of a process that exited after open.
    if source.kind() == io::ErrorKind::NotFound || source.raw_os_error() == Some(libc::ESRCH) {
        ProcfsError::Gone(pid)
    } else {
        ProcfsError::Io { path, source }
    }
}

/// One line of /proc/PID/maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vma {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// `rw-p` style permissions.
    pub perms: [u8; 4],
    /// Inode; 0 for anonymous memory.
    pub inode: u64,
    /// The path or pseudo-name (`[heap]`, `[stack]`, `[anon:name]`), empty for anonymous mmaps.
    pub name: String,
}

impl Vma {
    /// The addresses it spans.
    pub fn range(&self) -> Range {
        Range::new(self.start, self.end)
    }

    /// A private, anonymous, writable VMA from `start` to `end`, as the kernel would list an
    /// anonymous mmap.
    pub fn anonymous(start: u64, end: u64) -> Vma {
        Vma {
            start,
            end,
            perms: *b"rw-p",
            inode: 0,
            name: String::new(),
        }
    }

    /// Number of pages.
    pub fn pages(&self) -> u64 {
        (self.end - self.start) / PAGE_SIZE
    }

    /// Private, writable, anonymous memory: the heap, the stack, anonymous mmaps (named or
    /// not). That is what KSM can merge and what rksm scans. File-backed and shared mappings
    /// and the kernel's special areas (`[vdso]`, `[vvar]`, ...) are not.
    pub fn is_private_anonymous_writable(&self) -> bool {
        let private_writable =
            self.perms[0] == b'r' && self.perms[1] == b'w' && self.perms[3] == b'p';
        let anonymous = self.inode == 0
            && (self.name.is_empty()
                || self.name == "[heap]"
                || self.name == "[stack]"
                || self.name.starts_with("[anon:"));
        private_writable && anonymous
    }

    /// Parses one maps line: `start-end perms offset dev inode [name]`.
    ///
    /// ```
    /// let vma = rksm::kernel::procfs::Vma::parse("7f0000-8f0000 rw-p 00000000 00:00 0 ").unwrap();
    /// assert_eq!((vma.start, vma.end), (0x7f_0000, 0x8f_0000));
    /// assert!(vma.is_private_anonymous_writable());
    /// ```
    pub fn parse(line: &str) -> Option<Vma> {
        let mut fields = line.splitn(6, ' ');
        let (start, end) = fields.next()?.split_once('-')?;
        let perms: [u8; 4] = fields.next()?.as_bytes().try_into().ok()?;
        let _offset = fields.next()?;
        let _dev = fields.next()?;
        let inode = fields.next()?.parse().ok()?;
        let name = fields.next().unwrap_or("").trim().to_string();
        let vma = Vma {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            perms,
            inode,
            name,
        };
        (vma.start < vma.end && vma.start % PAGE_SIZE == 0 && vma.end % PAGE_SIZE == 0)
            .then_some(vma)
    }
}

/// Reads /proc/PID/maps. Malformed lines are skipped (they cannot be scanned safely).
pub fn read_maps(pid: u32) -> Result<Vec<Vma>, ProcfsError> {
    let path = PathBuf::from(format!("/proc/{pid}/maps"));
    let file = File::open(&path).map_err(|e| io_error(pid, path.clone(), e))?;
    let mut vmas = Vec::new();
    // A mapped file's path is raw bytes: see [`read_text`].
    for line in BufReader::new(file).split(b'\n') {
        let line = line.map_err(|e| io_error(pid, path.clone(), e))?;
        if let Some(vma) = Vma::parse(&String::from_utf8_lossy(&line)) {
            vmas.push(vma);
        }
    }
    Ok(vmas)
}

/// A /proc file as text. The kernel writes what processes chose (a command name, a mapped
/// file's path) as raw bytes, which need not be UTF-8: a byte that is not is read as U+FFFD,
/// so no process can make its files unreadable to rksm by its choice of name.
pub fn read_text(path: impl AsRef<std::path::Path>) -> io::Result<String> {
    let bytes = std::fs::read(path)?;
    Ok(match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}

/// The VMAs of `pid` that ksmd may merge (`mg` among their VmFlags in /proc/PID/smaps):
/// those rksm marked and those the process marked itself (`MADV_MERGEABLE`,
/// `PR_SET_MEMORY_MERGE`). smaps is the only place the kernel says so; reading it walks the
/// process's page tables, so it is for occasional checks, not for every page of a pass.
pub fn mergeable_ranges(pid: u32) -> Result<Vec<Range>, ProcfsError> {
    let path = PathBuf::from(format!("/proc/{pid}/smaps"));
    let text = read_text(&path).map_err(|e| io_error(pid, path, e))?;
    Ok(parse_mergeable_ranges(&text))
}

fn parse_mergeable_ranges(smaps: &str) -> Vec<Range> {
    let mut ranges = Vec::new();
    let mut current = None;
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(vma) = current.take() {
                if flags.split_whitespace().any(|f| f == "mg") {
                    ranges.push(vma);
                }
            }
        } else if let Some(vma) = Vma::parse(line) {
            current = Some(vma.range());
        }
    }
    ranges
}

/// Field `n` of a /proc/PID/stat line, numbered as in proc_pid_stat(5): 3 is the state, 4 the
/// parent pid, and so on (`n` >= 3). The command name (field 2) may itself hold spaces and
/// parentheses, so the fields after it start after the *last* `)`.
///
/// ```
/// let stat = "42 (a) b) R 1 42 42 0 -1 4194560";
/// assert_eq!(rksm::kernel::procfs::stat_field(stat, 3), Some("R"));
/// assert_eq!(rksm::kernel::procfs::stat_field(stat, 9), Some("4194560"));
/// ```
pub fn stat_field(stat: &str, n: usize) -> Option<&str> {
    stat.get(stat.rfind(')')? + 1..)?
        .split_ascii_whitespace()
        .nth(n.checked_sub(3)?)
}

/// The unit of the times in /proc/PID/stat (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
pub fn clock_ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100)
        .max(1) as f64
}

/// The kernel's own KSM account of one process, from /proc/PID/ksm_stat: the evidence rksm's
/// status shows next to its own counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KsmStat {
    /// Pages of the process mapped to KSM pages (`ksm_merging_pages`).
    pub merging_pages: u64,
    /// Zero pages KSM mapped in place of zero-filled ones (`ksm_zero_pages`).
    pub zero_pages: u64,
    /// ksmd's bookkeeping entries for the process (`ksm_rmap_items`).
    pub rmap_items: u64,
    /// Bytes KSM saved in the process minus its bookkeeping (`ksm_process_profit`, may be
    /// negative).
    pub process_profit: i64,
    /// Some of its memory is mergeable, by `madvise` or `PR_SET_MEMORY_MERGE`
    /// (`ksm_mergeable: yes` or `ksm_merge_any: yes`, Linux 6.8; before, ksmd keeps rmap
    /// items for it or merged some of its pages, which it does for mergeable memory only).
    pub mergeable: bool,
}

impl KsmStat {
    /// Parses the file's `name value` lines; lines it does not know (`ksm_merge_any: no`,
    /// fields of later kernels) are skipped. `None` if a known field holds no number.
    ///
    /// ```
    /// let stat = rksm::kernel::procfs::KsmStat::parse(
    ///     "ksm_rmap_items 7\nksm_zero_pages 0\nksm_merging_pages 5\nksm_process_profit -20\nksm_merge_any: no\n",
    /// )
    /// .unwrap();
    /// assert_eq!((stat.merging_pages, stat.process_profit), (5, -20));
    /// assert!(!stat.mergeable);
    /// // Before Linux 6.8 the file does not say; ksmd's rmap items do.
    /// let old = rksm::kernel::procfs::KsmStat::parse("ksm_rmap_items 3\n").unwrap();
    /// assert!(old.mergeable);
    /// ```
    pub fn parse(text: &str) -> Option<KsmStat> {
        let mut stat = KsmStat::default();
        let mut says_mergeable = false;
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(name), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            match name {
                "ksm_merging_pages" => stat.merging_pages = value.parse().ok()?,
                "ksm_zero_pages" => stat.zero_pages = value.parse().ok()?,
                "ksm_rmap_items" => stat.rmap_items = value.parse().ok()?,
                "ksm_process_profit" => stat.process_profit = value.parse().ok()?,
                "ksm_mergeable:" | "ksm_merge_any:" => {
                    says_mergeable = true;
                    stat.mergeable |= value == "yes";
                }
                _ => {}
            }
        }
        if !says_mergeable {
            stat.mergeable = stat.rmap_items > 0 || stat.merging_pages > 0;
        }
        Some(stat)
    }

    /// Reads /proc/PID/ksm_stat (absent before Linux 6.1, and for exited processes).
    pub fn read(pid: u32) -> Option<KsmStat> {
        Self::parse(&read_text(format!("/proc/{pid}/ksm_stat")).ok()?)
    }
}

/// The open files of `pid`: each fd number with what it refers to (a path, or
/// `anon_inode:[...]`). Empty once the process is gone.
pub fn open_files(pid: u32) -> Vec<(String, String)> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| {
            let target = std::fs::read_link(fd.path()).ok()?;
            Some((
                fd.file_name().to_string_lossy().into_owned(),
                target.to_string_lossy().into_owned(),
            ))
        })
        .collect()
}

/// Whether an open file (as [`open_files`] names it) is a KVM vCPU or the KVM device: a
/// guest's writes to its process's memory never fault in user mode.
pub fn is_kvm(file: &str) -> bool {
    file == "/dev/kvm" || file.starts_with("anon_inode:kvm-vcpu")
}

/// Whether an open file is a userfaultfd.
pub fn is_userfaultfd(file: &str) -> bool {
    file == "anon_inode:[userfaultfd]"
}

/// Whether `pid` holds a KVM vCPU or the KVM device.
pub fn holds_kvm(pid: u32) -> bool {
    open_files(pid).iter().any(|(_, file)| is_kvm(file))
}

/// Those of `pages` (of `pid`, sorted) mapped to KSM pages: one pagemap read per run of
/// consecutive pages, one kpageflags read per page mapped more than once.
pub fn ksm_mapped(pid: u32, pages: &[u64]) -> HashSet<u64> {
    mapped_where(pid, pages, |entry, flags| {
        !entry.exclusive() && flags().is_some_and(PageFlags::ksm)
    })
}

/// Those of `pages` (of `pid`, sorted) that are part of a transparent huge page.
pub fn thp_mapped(pid: u32, pages: &[u64]) -> HashSet<u64> {
    mapped_where(pid, pages, |_, flags| flags().is_some_and(PageFlags::thp))
}

/// Those of `pages` (sorted) present in `pid` whose entry and frame flags satisfy `keep`
/// (which reads kpageflags only if it asks): one pagemap read per run of pages.
fn mapped_where(
    pid: u32,
    pages: &[u64],
    keep: impl Fn(PagemapEntry, &dyn Fn() -> Option<PageFlags>) -> bool,
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
            if keep(entry, &|| flags.get(pfn).ok()) {
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
        let mut bytes = vec![0u8; entries.len() * 8];
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
        let n = filled / 8;
        for (entry, raw) in entries.iter_mut().zip(bytes.chunks_exact(8)).take(n) {
            *entry = PagemapEntry(u64::from_ne_bytes(raw.try_into().expect("8 bytes")));
        }
        Ok(n)
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

/// `text` with control characters written as `\xNN` (and `\` as `\\`): command names
/// and cgroup paths are chosen by other users, and must not reach a terminal or a log as
/// escape sequences.
///
/// ```
/// use rksm::kernel::procfs::printable;
/// assert_eq!(printable("python3"), "python3");
/// assert_eq!(printable("evil\x1b[2Jname\n"), "evil\\x1b[2Jname\\x0a");
/// ```
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(|c| c.is_control() || c == '\\') {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mergeable_ranges_are_the_vmas_flagged_mg() {
        let smaps = "\
7f0000-800000 rw-p 00000000 00:00 0 
Rss:                  64 kB
VmFlags: rd wr mr mw me ac mg 
800000-900000 rw-p 00000000 00:00 0 
VmFlags: rd wr mr mw me ac 
55d000-55e000 r--p 00000000 08:01 1234                       /usr/bin/mg
VmFlags: rd mr mw me mg 
";
        assert_eq!(
            parse_mergeable_ranges(smaps),
            [
                Range::new(0x7f_0000, 0x80_0000),
                Range::new(0x55_d000, 0x55_e000)
            ]
        );
    }

    #[test]
    fn parses_the_kinds_of_maps_lines() {
        let heap = Vma::parse(
            "55830593c000-55830595d000 rw-p 00000000 00:00 0                          [heap]",
        )
        .unwrap();
        assert_eq!(heap.name, "[heap]");
        assert!(heap.is_private_anonymous_writable());
        assert_eq!(heap.pages(), 0x21);

        let anon = Vma::parse("7fe7e0a3f000-7fe7e0a61000 rw-p 00000000 00:00 0 ").unwrap();
        assert!(anon.is_private_anonymous_writable());
        let named =
            Vma::parse("7fe7e0a3f000-7fe7e0a61000 rw-p 00000000 00:00 0   [anon:worker heap]")
                .unwrap();
        assert_eq!(named.name, "[anon:worker heap]");
        assert!(named.is_private_anonymous_writable());

        let data = Vma::parse("7fe7e0c97000-7fe7e0c99000 rw-p 001d3000 fe:00 326279 /usr/lib/x86_64-linux-gnu/libc.so.6").unwrap();
        assert!(!data.is_private_anonymous_writable(), "file-backed");
        let shared =
            Vma::parse("7fe7e0a3f000-7fe7e0a61000 rw-s 00000000 00:01 1234 /dev/zero (deleted)")
                .unwrap();
        assert!(!shared.is_private_anonymous_writable(), "shared");
        let ro = Vma::parse(
            "7fe7e0cb1000-7fe7e0cb5000 r--p 00000000 00:00 0                          [vvar]",
        )
        .unwrap();
        assert!(!ro.is_private_anonymous_writable(), "read-only");
        let vdso = Vma::parse("7ffd1000-7ffd3000 rw-p 00000000 00:00 0 [vdso]").unwrap();
        assert!(!vdso.is_private_anonymous_writable(), "special");
        let path_with_spaces = Vma::parse("1000-2000 r--p 00000000 fe:00 1 /tmp/a b c").unwrap();
        assert_eq!(path_with_spaces.name, "/tmp/a b c");
    }

    #[test]
    fn malformed_maps_lines_are_rejected() {
        for bad in [
            "",
            "zzzz-1000 rw-p 0 0 0",
            "2000-1000 rw-p 00000000 00:00 0",
            "1000-2000 rw-p",
            "1001-2000 rw-p 00000000 00:00 0",
            "1000-2000 rw 00000000 00:00 0",
        ] {
            assert_eq!(Vma::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn pagemap_bits() {
        let e = PagemapEntry((1 << 63) | (1 << 56) | 0x1234);
        assert!(
            e.present() && e.exclusive() && !e.swapped() && !e.uffd_wp() && !e.file_or_shared()
        );
        assert_eq!(e.pfn(), Some(0x1234));
        assert_eq!(PagemapEntry(1 << 62).pfn(), None);
        assert_eq!(PagemapEntry(0).pfn(), None);
        assert!(PagemapEntry(1 << 57).uffd_wp());
    }

    #[test]
    fn kpageflags_bits() {
        assert!(PageFlags(1 << 21).ksm());
        assert!(PageFlags(1 << 24).zero_page());
        assert!(!PageFlags(1 << 22).zero_page());
    }

    /// The probe agrees with what kpageflags says of a plain page read here; and where it
    /// says the flag can be trusted, a plain page is no KSM page.
    #[test]
    fn a_plain_anonymous_page_is_not_a_ksm_page_where_the_flag_is_trusted() {
        let mut page = vec![0u8; 4 * PAGE];
        let addr = (page.as_mut_ptr() as u64).next_multiple_of(PAGE_SIZE);
        // SAFETY: inside the vector, which lives to the end of the test.
        unsafe { (addr as *mut u8).write_volatile(7) };
        let pagemap = Pagemap::open(std::process::id()).unwrap();
        let mut entry = [PagemapEntry(0)];
        pagemap.read(addr, &mut entry).unwrap();
        let pfn = entry[0].pfn().expect("present, and root sees frames");
        let flags = KpageFlags::open().unwrap().get(pfn).unwrap();
        std::hint::black_box(&page);
        assert!(flags.0 & (1 << 12) != 0, "anonymous: {:#x}", flags.0);
        assert!(entry[0].exclusive(), "mapped once");
        assert_eq!(ksm_flag_reliable(), !flags.ksm(), "{:#x}", flags.0);
    }

    #[test]
    fn reads_its_own_maps_and_pagemap() {
        // The page holding this local variable (on this test thread's stack) is present.
        let local = 0u8;
        let addr = std::hint::black_box(&local) as *const u8 as u64;
        let vmas = read_maps(std::process::id()).unwrap();
        let vma = vmas
            .iter()
            .find(|v| v.start <= addr && addr < v.end)
            .expect("a mapping");
        assert!(vma.is_private_anonymous_writable(), "{vma:?}");
        let pagemap = Pagemap::open(std::process::id()).unwrap();
        let mut entries = vec![PagemapEntry(0); vma.pages() as usize];
        assert_eq!(
            pagemap.read(vma.start, &mut entries).unwrap(),
            entries.len()
        );
        let index = ((addr & !(PAGE_SIZE - 1)) - vma.start) / PAGE_SIZE;
        assert!(entries[index as usize].present());
    }

    proptest::proptest! {
        /// Whatever /proc hands over (or a fuzzer invents), parsing never panics, and what it
        /// accepts is a well-formed, page-aligned, non-empty range.
        #[test]
        fn maps_parsing_never_panics(line in "\\PC*") {
            if let Some(vma) = Vma::parse(&line) {
                proptest::prop_assert!(vma.start < vma.end && vma.start % PAGE_SIZE == 0 && vma.end % PAGE_SIZE == 0);
            }
        }

        /// Lines in the kernel's format come back field for field.
        #[test]
        fn well_formed_maps_lines_round_trip(
            start in 0u64..(1 << 35), pages in 1u64..1_000_000, w in proptest::bool::ANY,
            inode in 0u64..10_000, name in "(|\\[heap\\]|\\[stack\\]|\\[anon:[a-z ]{1,10}\\]|/[a-z/ ]{1,20})",
        ) {
            let (s, e) = (start * PAGE_SIZE, (start + pages) * PAGE_SIZE);
            let perms = if w { "rw-p" } else { "r--p" };
            let line = format!("{s:x}-{e:x} {perms} 00000000 00:00 {inode} {name}");
            let vma = Vma::parse(&line).expect("well-formed");
            proptest::prop_assert_eq!((vma.start, vma.end, vma.inode), (s, e, inode));
            proptest::prop_assert_eq!(vma.name.as_str(), name.trim());
        }

        /// Any ksm_stat text parses or is refused without a panic; the kernel's format round
        /// trips.
        #[test]
        fn ksm_stat_parsing_never_panics(text in "\\PC{0,200}") {
            let _ = KsmStat::parse(&text);
        }

        #[test]
        fn well_formed_ksm_stat_round_trips(
            rmap in 0u64..1 << 40, zero in 0u64..1 << 40, merging in 0u64..1 << 40,
            profit in proptest::num::i64::ANY,
        ) {
            let text = format!(
                "ksm_rmap_items {rmap}\nksm_zero_pages {zero}\nksm_merging_pages {merging}\nksm_process_profit {profit}\nksm_merge_any: no\nksm_mergeable: yes\n"
            );
            proptest::prop_assert_eq!(
                KsmStat::parse(&text),
                Some(KsmStat { merging_pages: merging, zero_pages: zero, rmap_items: rmap, process_profit: profit, mergeable: true })
            );
        }

        /// Every pagemap bit pattern decodes without panicking, consistently.
        #[test]
        fn pagemap_entries_decode_consistently(raw in proptest::num::u64::ANY) {
            let e = PagemapEntry(raw);
            proptest::prop_assert_eq!(e.pfn().is_some(), e.present() && !e.swapped());
        }
    }

    #[test]
    fn every_maps_line_in_the_corpus_parses() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
        let mut lines = 0;
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if !name.starts_with("maps-") {
                continue;
            }
            for line in std::fs::read_to_string(entry.path()).unwrap().lines() {
                assert!(Vma::parse(line).is_some(), "{name}: {line}");
                lines += 1;
            }
        }
        assert!(lines >= 20, "corpus too small: {lines} lines");
    }

    #[test]
    fn every_ksm_stat_in_the_corpus_parses() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
        let mut merged = 0;
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            if entry.file_name().to_string_lossy().starts_with("ksm_stat-") {
                let text = std::fs::read_to_string(entry.path()).unwrap();
                let stat = KsmStat::parse(&text).expect("parses");
                merged += stat.merging_pages;
            }
        }
        assert!(
            merged > 0,
            "the corpus should hold a merged process's ksm_stat"
        );
    }

    #[test]
    fn a_missing_process_is_gone() {
        assert!(matches!(
            read_maps(4_194_305),
            Err(ProcfsError::Gone(4_194_305))
        ));
        assert!(matches!(
            Pagemap::open(4_194_305),
            Err(ProcfsError::Gone(4_194_305))
        ));
    }
}
