//! /proc/PID/maps and smaps: a process's VMAs, and which of them ksmd may merge.

use std::{
    fs::File,
    io::{BufRead, BufReader},
    path::PathBuf,
};

use rksm_common::PAGE_SIZE;

use super::{io_error, read_text, ProcfsError};
use crate::kernel::ranges::Range;

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
        (vma.start < vma.end
            && vma.start.is_multiple_of(PAGE_SIZE)
            && vma.end.is_multiple_of(PAGE_SIZE))
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

/// The VMAs of `pid` that ksmd may merge (`mg` among their VmFlags in /proc/PID/smaps):
/// those rksm marked and those the process marked itself (`MADV_MERGEABLE`,
/// `PR_SET_MEMORY_MERGE`). smaps is the only place the kernel says so; reading it walks the
/// process's page tables, so it is for occasional checks, not for every page of a pass.
pub fn mergeable_ranges(pid: u32) -> Result<Vec<Range>, ProcfsError> {
    let path = PathBuf::from(format!("/proc/{pid}/smaps"));
    let text = read_text(&path).map_err(|e| io_error(pid, path, e))?;
    Ok(parse_mergeable_ranges(&text))
}

pub(super) fn parse_mergeable_ranges(smaps: &str) -> Vec<Range> {
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
