//! Soft-dirty: write protection driven from outside the target, on any kernel that keeps it.
//!
//! Kernels before 6.7 have no asynchronous userfaultfd write protection, but the ones
//! distributions ship (Debian, Ubuntu, RHEL, Fedora) are built with `CONFIG_MEM_SOFT_DIRTY`:
//! writing `4` to /proc/PID/clear_refs write-protects every page of the process and clears
//! its soft-dirty bits, and every later write faults (user or kernel mode, which the tracer
//! sees) and sets the page's bit 55 in /proc/PID/pagemap again, a write through
//! get_user_pages included. Nothing is borrowed and no fd is put inside the target. The
//! price: a clear walks the page tables of the whole address space under the target's mmap
//! lock, and reading the bits back costs a pagemap entry per virtual page (there is no
//! PAGEMAP_SCAN before 6.7 to skip holes). And a clear is all-or-nothing: every bit of the
//! process goes at once, so bits must be read right before they are cleared.
//!
//! The bits are one per process, shared by whoever clears them: a program that tracks its
//! own writes (Boehm GC's incremental mode keeps /proc/self/clear_refs open; CRIU clears a
//! process it pre-dumps) would lose writes if rksm cleared too. [`clear_refs_holder`] finds
//! the first kind before every clear.
//!
//! Bit 55 is conservative: a VMA created or grown since the last clear (mmap, brk, a merge
//! with a neighbour) reports every page, holes included, as soft-dirty until the next clear.

use std::{
    fs::OpenOptions,
    io::{self, Write},
    sync::OnceLock,
    time::{Duration, Instant},
};

use rksm_common::{PAGE, PAGE_SIZE};

use crate::kernel::{
    limits,
    process::Process,
    procfs::{self, Pagemap, PagemapEntry, ProcfsError},
    ranges::Range,
};

/// Entries read from pagemap at a time (256 KiB of entries, 512 MiB of address space).
const READ_ENTRIES: usize = 32 * 1024;

/// Errors clearing or reading a process's soft-dirty bits.
#[derive(Debug, thiserror::Error)]
pub enum SoftDirtyError {
    /// The process exited.
    #[error("process {0} has exited")]
    Gone(u32),
    /// The process tracks its own writes with soft-dirty bits: clearing them would lose
    /// writes it has not read yet.
    #[error("pid {pid} clears its own soft-dirty bits ({holder})")]
    UsedByTarget {
        /// The process.
        pid: u32,
        /// What shows it (an open clear_refs).
        holder: String,
    },
    /// A file could not be opened, written or read.
    #[error("pid {pid}: {what}: {source}")]
    Io {
        /// The process.
        pid: u32,
        /// Which file and what was done to it.
        what: &'static str,
        /// What the kernel said.
        source: io::Error,
    },
}

impl SoftDirtyError {
    /// Whether rksm had no file descriptor left: a condition that passes.
    pub fn out_of_files(&self) -> bool {
        matches!(self, SoftDirtyError::Io { source, .. } if limits::out_of_files(source))
    }

    fn pagemap(pid: u32, what: &'static str, e: ProcfsError) -> Self {
        match e {
            ProcfsError::Gone(_) => SoftDirtyError::Gone(pid),
            ProcfsError::Io { source, .. } => SoftDirtyError::Io { pid, what, source },
        }
    }
}

/// An anonymous private page of rksm's own, unmapped when dropped (for the probes).
struct ProbePage(*mut u8);

impl ProbePage {
    fn map() -> Option<Self> {
        // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        (p != libc::MAP_FAILED).then_some(ProbePage(p.cast()))
    }

    fn entry(&self) -> Option<PagemapEntry> {
        let pagemap = Pagemap::open(std::process::id()).ok()?;
        let mut entry = [PagemapEntry(0)];
        (pagemap.read(self.0 as u64, &mut entry).ok()? == 1).then_some(entry[0])
    }
}

impl Drop for ProbePage {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of that size, unmapped once.
        unsafe { libc::munmap(self.0.cast(), PAGE) };
    }
}

/// Whether this kernel keeps soft-dirty bits (`CONFIG_MEM_SOFT_DIRTY`). A page of rksm's own,
/// just mapped and written, reports bit 55 if and only if it does; nothing is cleared.
pub fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let Some(page) = ProbePage::map() else {
            return false;
        };
        // SAFETY: the page is mapped, writable and ours.
        unsafe { page.0.write_volatile(1) };
        page.entry().is_some_and(PagemapEntry::soft_dirty)
    })
}

/// The frame of the kernel's zero page, as pagemap shows it to rksm (None without the
/// privilege to see frames). A page mapped to it after a clear was read, not written, and
/// shows no soft-dirty bit; but if it held something else before (`MADV_DONTNEED`, then a
/// read) its content changed.
pub fn zero_pfn() -> Option<u64> {
    static ZERO: OnceLock<Option<u64>> = OnceLock::new();
    *ZERO.get_or_init(|| {
        let page = ProbePage::map()?;
        // SAFETY: the page is mapped and readable; a read fault maps the zero page.
        let byte = unsafe { page.0.read_volatile() };
        std::hint::black_box(byte);
        page.entry()?.pfn().filter(|&pfn| pfn != 0)
    })
}

/// What reading the bits of some ranges found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Bits {
    /// Pages present (or swapped out) with their soft-dirty bit set: written since the last
    /// clear, or in a VMA created or grown since.
    pub written: Vec<u64>,
    /// Present pages mapped to the zero page.
    pub zero: Vec<u64>,
    /// Present pages with their bit clear, of those asked about one by one.
    pub clean: Vec<u64>,
    /// Pagemap entries read.
    pub entries: u64,
}

/// One process's soft-dirty bits: its pagemap, and the clear.
#[derive(Debug)]
pub struct SoftDirty {
    pid: u32,
    pagemap: Pagemap,
    zero_pfn: Option<u64>,
}

impl SoftDirty {
    /// Opens `process`'s pagemap; nothing is cleared yet.
    pub fn open(process: &Process) -> Result<Self, SoftDirtyError> {
        let pid = process.pid();
        let pagemap =
            Pagemap::open(pid).map_err(|e| SoftDirtyError::pagemap(pid, "opening pagemap", e))?;
        Ok(SoftDirty {
            pid,
            pagemap,
            zero_pfn: zero_pfn(),
        })
    }

    /// The process's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Clears every soft-dirty bit of `process` and write-protects all its pages, unless it
    /// holds a clear_refs of its own open. Returns how long the kernel took.
    pub fn clear(&self, process: &Process) -> Result<Duration, SoftDirtyError> {
        let pid = self.pid;
        if let Some(holder) = clear_refs_holder(pid) {
            return Err(SoftDirtyError::UsedByTarget { pid, holder });
        }
        let io = |what| {
            move |source: io::Error| match source.raw_os_error() {
                Some(libc::ESRCH | libc::ENOENT) => SoftDirtyError::Gone(pid),
                _ => SoftDirtyError::Io { pid, what, source },
            }
        };
        let mut file = OpenOptions::new()
            .write(true)
            .open(format!("/proc/{pid}/clear_refs"))
            .map_err(io("opening /proc/PID/clear_refs"))?;
        // The pidfd pins the process: alive now, the pid cannot have been reused, and the
        // file opened is its own.
        if process.has_exited() {
            return Err(SoftDirtyError::Gone(pid));
        }
        let started = Instant::now();
        file.write_all(b"4")
            .map_err(io("writing 4 to /proc/PID/clear_refs"))?;
        Ok(started.elapsed())
    }

    /// Reads the bits of every page in `ranges` (sorted): the written pages and the pages
    /// mapped to the zero page.
    pub fn read(&self, ranges: &[Range]) -> Result<Bits, SoftDirtyError> {
        let mut bits = Bits::default();
        // As many entries as asked for, up to a batch: an audit's slice is small.
        let asked: u64 = ranges.iter().map(Range::pages).sum();
        let mut entries = vec![PagemapEntry(0); (asked as usize).min(READ_ENTRIES)];
        for range in ranges {
            let mut at = range.start;
            while at < range.end {
                let want = (((range.end - at) / PAGE_SIZE) as usize).min(READ_ENTRIES);
                let got = self
                    .pagemap
                    .read(at, &mut entries[..want])
                    .map_err(|e| SoftDirtyError::pagemap(self.pid, "reading pagemap", e))?;
                if got == 0 {
                    break;
                }
                for (i, entry) in entries[..got].iter().enumerate() {
                    let page = at + i as u64 * PAGE_SIZE;
                    self.sort(page, *entry, &mut bits, false);
                }
                bits.entries += got as u64;
                at += got as u64 * PAGE_SIZE;
            }
        }
        Ok(bits)
    }

    /// Reads the bits of `pages` (sorted), one read per run of consecutive pages; present
    /// pages whose bit is clear are listed in [`Bits::clean`].
    pub fn read_pages(&self, pages: &[u64]) -> Result<Bits, SoftDirtyError> {
        let mut bits = Bits::default();
        let mut entries = vec![PagemapEntry(0); 512];
        for run in crate::kernel::ranges::page_runs(pages, entries.len()) {
            let got = self
                .pagemap
                .read(run[0], &mut entries[..run.len()])
                .map_err(|e| SoftDirtyError::pagemap(self.pid, "reading pagemap", e))?;
            for (&page, entry) in run.iter().zip(&entries[..got]) {
                self.sort(page, *entry, &mut bits, true);
            }
            bits.entries += got as u64;
        }
        Ok(bits)
    }

    fn sort(&self, page: u64, entry: PagemapEntry, bits: &mut Bits, clean: bool) {
        if entry.present() && self.zero_pfn.is_some() && entry.pfn() == self.zero_pfn {
            bits.zero.push(page);
        } else if entry.soft_dirty() && (entry.present() || entry.swapped()) {
            bits.written.push(page);
        } else if clean && entry.present() {
            bits.clean.push(page);
        }
    }
}

/// What in `pid` shows that it clears soft-dirty bits itself: an open clear_refs (its own,
/// as Boehm GC keeps /proc/self/clear_refs, or another process's), as `fd N -> PATH`.
pub fn clear_refs_holder(pid: u32) -> Option<String> {
    clear_refs_among(&procfs::open_files(pid))
}

/// The first clear_refs among `files` (as [`procfs::open_files`] lists them).
pub fn clear_refs_among(files: &[(String, String)]) -> Option<String> {
    files.iter().find_map(|(fd, path)| {
        let proc_file = path
            .strip_prefix("/proc/")
            .and_then(|rest| rest.split_once('/'));
        matches!(proc_file, Some((_, "clear_refs")))
            .then(|| format!("fd {fd} -> {}", procfs::printable(path)))
    })
}

/// The minor faults of every thread of `pid` so far (/proc/PID/stat field 10): a write fault
/// on a page protected by a clear counts here before the clear can start.
pub fn minor_faults(pid: u32) -> Option<u64> {
    let stat = procfs::read_text(format!("/proc/{pid}/stat")).ok()?;
    procfs::stat_field(&stat, 10)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page of this process's own that existed before a clear of its own soft-dirty bits,
    /// read back before and after a write: the behaviour the probe predicts, checked
    /// independently of it.
    #[test]
    fn the_probe_predicts_what_a_clear_and_a_write_do() {
        let page = ProbePage::map().unwrap();
        // SAFETY: mapped, writable, ours.
        unsafe { page.0.write_volatile(1) };
        let me = std::process::id();
        std::fs::write(format!("/proc/{me}/clear_refs"), "4").expect("clearing our own bits");
        assert!(!page.entry().unwrap().soft_dirty(), "clean after a clear");
        // SAFETY: as above.
        unsafe { page.0.write_volatile(2) };
        assert_eq!(page.entry().unwrap().soft_dirty(), supported());
    }

    #[test]
    fn the_zero_page_is_found_where_kpageflags_says_it_is() {
        let pfn = zero_pfn().expect("root sees frames");
        let flags = procfs::KpageFlags::open().unwrap().get(pfn).unwrap();
        assert!(flags.zero_page(), "frame {pfn} is not the zero page");
    }

    #[test]
    fn a_clear_refs_held_open_is_found_and_named() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "exec 7>/proc/self/clear_refs; echo open; read line"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut opened = String::new();
        io::BufRead::read_line(
            &mut io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut opened,
        )
        .unwrap();
        assert_eq!(opened, "open\n");
        let pid = child.id();
        assert_eq!(
            clear_refs_holder(pid),
            Some(format!("fd 7 -> /proc/{pid}/clear_refs"))
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(clear_refs_holder(std::process::id()), None);
    }

    #[test]
    fn minor_faults_are_read_and_grow() {
        let before = minor_faults(std::process::id()).expect("own stat");
        let page = ProbePage::map().unwrap();
        // SAFETY: mapped, writable, ours.
        unsafe { page.0.write_volatile(1) };
        assert!(minor_faults(std::process::id()).unwrap() > before);
    }
}
