//! /proc parsing, in one place: maps (`maps`), pagemap and kpageflags (`pagemap`), stat,
//! ksm_stat and open files.
//!
//! rksm decides what to read, what is already shared and what is a KSM or zero page entirely
//! from what the kernel reports in /proc. Each file has its own format and its own way of
//! failing when a process exits or unmaps memory mid-read; this module turns all of that into
//! plain values and typed errors, and is the only place that knows the bit layouts.

use std::{io, path::PathBuf};

mod maps;
mod pagemap;

pub use maps::{mergeable_ranges, read_maps, Vma};
pub use pagemap::{
    ksm_flag_reliable, ksm_mapped, ksm_or_zero_mapped, thp_enabled, thp_mapped, KpageFlags,
    PageFlags, Pagemap, PagemapEntry,
};
pub(crate) use pagemap::{
    PageRegion, PageScan, PAGE_IS_WRITTEN, PM_SCAN_CHECK_WPASYNC, PM_SCAN_WP_MATCHING,
};

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

pub(crate) fn io_error(pid: u32, path: PathBuf, source: io::Error) -> ProcfsError {
    // ESRCH comes back from pagemap reads of a process that exited after open.
    if source.kind() == io::ErrorKind::NotFound || source.raw_os_error() == Some(libc::ESRCH) {
        ProcfsError::Gone(pid)
    } else {
        ProcfsError::Io { path, source }
    }
}

/// A /proc file as text. The kernel writes what processes chose (a command name, a mapped
/// file's path) as raw bytes, which need not be UTF-8: a byte that is not is read as U+FFFD,
/// so no process can make its files unreadable to rksm by its choice of name.
///
/// /proc files say they are empty, so `std::fs::read` would ask their size and then probe
/// them 32 bytes at a time: five system calls of a pass's hundreds per file. One read into
/// a page's room takes most of them whole.
pub fn read_text(path: impl AsRef<std::path::Path>) -> io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(4096);
    std::fs::File::open(path)?.read_to_end(&mut bytes)?;
    // Kept no larger than the text: a pass holds a target's files while it asks about it.
    bytes.shrink_to_fit();
    Ok(match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
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

/// The CPU time this process has used since it started, all its threads, in seconds
/// (`getrusage(RUSAGE_SELF)`: user and system, to the microsecond).
pub fn own_cpu_seconds() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    usage.map_or(0.0, |u| {
        let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
        secs(u.user_time()) + secs(u.system_time())
    })
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
    use rksm_common::{PAGE, PAGE_SIZE};

    use super::{maps::parse_mergeable_ranges, *};
    use crate::kernel::ranges::Range;

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
