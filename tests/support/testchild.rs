//! `rksm-testchild`: a process with exactly the memory a test asks for.
//!
//! Integration tests drive it over stdin/stdout, one command per line, so that they know
//! which pages it touched, when, and with what contents (or give it the commands as one
//! argument, `;`-separated, after which it sleeps until killed, holding no pipe):
//!
//! - `map PAGES` → `mapped ID ADDR`: a private anonymous region, huge pages off (a huge
//!   page would make one fault cover 512 pages).
//! - `mapsparse PAGES` → `mapped ID ADDR`: the same with MAP_NORESERVE (a terabyte arena).
//! - `maphuge PAGES` → `mapped ID ADDR`: 2 MiB-aligned, huge pages asked for
//!   (`MADV_HUGEPAGE`), so that a write fault may map a transparent huge page.
//! - `clearrefs` → `ok`: clears its own soft-dirty bits through /proc/self/clear_refs, which
//!   it keeps open from then on, as Boehm GC's incremental mode does.
//! - `softdirty ID FIRST COUNT` → `softdirty N`: how many of the pages its own pagemap shows
//!   soft-dirty (bit 55).
//! - `write ID FIRST COUNT SEED` → `ok`: fills pages `FIRST..FIRST+COUNT` with the content of
//!   `SEED` (the same content for every page, so equal seeds make duplicate pages).
//! - `unique ID FIRST COUNT SEED` → `ok`: page `FIRST+i` gets the content of `SEED+i`.
//! - `fill ID FIRST COUNT BYTE` → `ok`: every byte of the pages is `BYTE` (0: zero-filled
//!   private pages, as opposed to the kernel's zero page that reading a fresh page maps).
//! - `read ID FIRST COUNT` → `ok SUM`: reads one word of each page, writes nothing.
//! - `readinto ID FIRST COUNT PATH HOW` → `ok`: fills the pages from the file at PATH, the
//!   kernel writing them for the child: HOW is `read` (read(2)), `direct` (an O_DIRECT read:
//!   get_user_pages, no fault at all) or `recv` (a thread sends the file over a socket pair
//!   and recv(2) with MSG_WAITALL takes it in).
//! - `dontneed ID FIRST COUNT` → `ok`: MADV_DONTNEED (the pages read as zeros until written).
//! - `mremap ID TO` → `ok`: moves region ID onto region TO's place (same size), which it
//!   replaces; region ID then names the moved pages.
//! - `fork` → `forked PID`: a child sharing all memory copy-on-write, killed with its parent.
//! - `unmap ID` → `ok`: unmaps the region.
//! - `threads N` → `threads ADDR`: N threads that keep incrementing the u64 at ADDR.
//! - `sleep MS` → `slept`: sleeps in `clock_nanosleep` (a restartable system call).
//! - `epoll MS TIMEOUT` → `epoll eintr N`: waits in `epoll_wait` (TIMEOUT ms at a time, -1:
//!   no timeout) until a timer fires after MS ms, and counts the waits that failed with EINTR,
//!   as an event loop would see them; `epoll MS TIMEOUT longest` also gives the longest wait
//!   that timed out, in ms (`epoll eintr N longest T`).
//! - `epollstop` → `stopped after N waits`: sets a SIGTERM handler (SA_RESTART, which
//!   `epoll_wait` ignores) that sets a flag, then loops `while (!stop) epoll_wait(-1)`, as
//!   an event loop does.
//! - `signals N` → `signals ok` or `signals wrong ...`: takes N queued SIGRTMIN signals whose
//!   `si_value` must count 0, 1, 2, ... with `si_code` SI_QUEUE (`sigqueue` from the test),
//!   waiting up to 60 s for all of them.
//! - `vfork MS` → `vforked`: vforks a child that sleeps MS ms, then exits: until then the
//!   (single) thread is in the kernel's vfork wait.
//! - `stat PATH` → `stat ok` or `stat error ...`: a `stat(2)` of PATH (on a FUSE mount whose
//!   server never answers, the thread waits in the kernel until the connection is aborted).
//! - `setuid UID` → `ok`: all its user ids become UID (a daemon dropping root), and it stays
//!   dumpable (`PR_SET_DUMPABLE` 1, which a uid change resets).
//! - `mergeable ID` → `ok`: marks region ID `MADV_MERGEABLE` itself, as qemu marks its RAM.
//! - `nodump` → `ok`: `prctl(PR_SET_DUMPABLE, 0)`, as ssh-agent does.
//! - `name NAME` → `ok`: its command name (`/proc/PID/comm`) becomes NAME.
//! - `setids` → `ok`: sets its effective uid to nobody's, keeping real and saved (as a set-uid
//!   program's ids differ).
//! - `seccomp` → `ok`: installs a seccomp filter that allows everything.
//! - `seccompworker` → `ok`: starts a thread that installs a filter of its own, killing the
//!   process on `madvise`, then spins (running, so the least disturbed thread to borrow).
//! - `uffd ID` → `ok`: registers the (fully written) region with a userfaultfd of its own,
//!   as a process using userfaultfd for itself would.
//! - `rseq MS THREADS SPIN` → `rseq counter C commits N aborts A`: THREADS threads pinned to
//!   CPU 0 add to one counter in rseq critical sections (SPIN pauses between load and
//!   commit) for MS ms; C equals N unless a section completed after a preemption.
//! - `ownuffd ID MODE` → `ownuffd ok` or `ownuffd error E`: creates a userfaultfd and at
//!   once registers region ID with it, MODE `wp` or `missing` (as qemu's postcopy and
//!   background snapshots do); the fd stays open.
//! - `raceuffd ID MODE MS` → `raceuffd ok`, `raceuffd error E` or `raceuffd notarmed`: waits
//!   up to MS ms for region ID to be write-protected by someone else's userfaultfd (rksm's:
//!   `uw` in its smaps VmFlags), then does `ownuffd` at once.
//! - `verify ID FIRST COUNT SEED` → `ok` or `mismatch PAGE`: checks contents are intact.
//! - `verifyunique ID FIRST COUNT SEED` → the same for pages written with `unique`.
//! - `verifyfill ID FIRST COUNT BYTE` → the same for pages written with `fill`.
//! - `pid` → `pid N`.
//! - `exec` → `ok`, then executes itself again: same pid, fresh memory, no regions.
//! - `exit` → exits 0.
//!
//! Accesses are volatile so the compiler can neither drop nor merge them.

mod rseq_counter;

use std::{
    io::{self, BufRead, Write},
    os::unix::fs::OpenOptionsExt,
};

use rksm_common::PAGE;
const WORDS: usize = PAGE / 8;

fn word(seed: u64, i: usize) -> u64 {
    (seed.wrapping_add(1))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left((i % 64) as u32)
        ^ i as u64
}

/// Word `i` of page `p` of a look-alike run (`alike`): pages that the sampler's bytes
/// (`rksm_common::sample::OFFSETS`) cannot tell apart, different elsewhere: `sample`:
/// everything else unique; `oddbyte`: zeros but one value at an odd offset; `lastline`: one
/// content but for the first half of the last cache line. Pages of the same `seed` and index
/// are identical; pages of different seeds differ.
fn alike_word(kind: &str, seed: u64, p: usize, i: usize) -> u64 {
    use rksm_common::sample::{OFFSETS, SAMPLE_BYTES};
    let sampled = OFFSETS
        .iter()
        .any(|&at| (at as usize / 8..(at as usize + SAMPLE_BYTES) / 8).contains(&i));
    match kind {
        "sample" if sampled => 0x5a5a_5a5a_5a5a_5a5a,
        "sample" => word(seed + p as u64, i),
        // From byte 1001 on (word 125 from its second byte): one value per seed and page.
        "oddbyte" if i == 125 => (seed + p as u64) << 8,
        "oddbyte" => 0,
        "lastline" if (504..508).contains(&i) => word(seed + p as u64, i),
        _ => word(0, i),
    }
}

#[derive(Clone, Copy)]
struct Region {
    base: *mut u64,
    pages: usize,
}

impl Region {
    /// Maps `pages` fresh pages, at `at` if given (never over an existing mapping).
    fn map(pages: usize, at: Option<usize>, noreserve: bool) -> Result<Region, String> {
        let len = pages * PAGE;
        let fixed = if at.is_some() {
            libc::MAP_FIXED_NOREPLACE
        } else {
            0
        } | if noreserve { libc::MAP_NORESERVE } else { 0 };
        // SAFETY: a fresh anonymous mapping; MAP_FIXED_NOREPLACE fails rather than replace
        // an existing one, so no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                at.unwrap_or(0) as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap: {}", io::Error::last_os_error()));
        }
        // SAFETY: ptr..ptr+len is the mapping just created.
        if unsafe { libc::madvise(ptr, len, libc::MADV_NOHUGEPAGE) } != 0 {
            return Err(format!("madvise: {}", io::Error::last_os_error()));
        }
        Ok(Region {
            base: ptr.cast(),
            pages,
        })
    }

    /// Maps `pages` fresh pages at a 2 MiB boundary and asks for transparent huge pages.
    fn map_huge(pages: usize) -> Result<Region, String> {
        const HUGE: usize = 2 << 20;
        let len = pages * PAGE;
        // SAFETY: a fresh anonymous mapping, large enough to hold an aligned one.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap: {}", io::Error::last_os_error()));
        }
        let aligned = (ptr as usize).next_multiple_of(HUGE);
        // SAFETY: aligned..aligned+len lies inside the mapping just made (HUGE spare bytes).
        if unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } != 0 {
            return Err(format!("madvise: {}", io::Error::last_os_error()));
        }
        Ok(Region {
            base: aligned as *mut u64,
            pages,
        })
    }

    fn page(&self, index: usize) -> Result<*mut u64, String> {
        if index >= self.pages {
            return Err(format!(
                "page {index} is outside the region of {} pages",
                self.pages
            ));
        }
        // SAFETY: index < pages, so the offset stays inside the mapping.
        Ok(unsafe { self.base.add(index * WORDS) })
    }
}

/// Creates a userfaultfd and registers region `r` with it at once (`mode` `wp` or `missing`),
/// as qemu does for postcopy or a background snapshot; the fd stays open. The errno's name
/// on failure.
fn own_userfaultfd(r: Region, mode: &str) -> Result<(), String> {
    #[repr(C)]
    struct Api {
        api: u64,
        features: u64,
        ioctls: u64,
    }
    #[repr(C)]
    struct Register {
        start: u64,
        len: u64,
        mode: u64,
        ioctls: u64,
    }
    let mode = match mode {
        "missing" => 1,
        "wp" => 2,
        other => return Err(format!("unknown mode {other}")),
    };
    let errno = || {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EBUSY) => "EBUSY".to_string(),
            _ => e.to_string(),
        }
    };
    // SAFETY: userfaultfd returns a new fd; the ioctls get correctly laid out structs that
    // outlive the calls.
    unsafe {
        // UFFD_USER_MODE_ONLY (1): what an unprivileged process may create.
        let fd = libc::syscall(
            libc::SYS_userfaultfd,
            libc::O_CLOEXEC | libc::O_NONBLOCK | 1,
        ) as i32;
        if fd < 0 {
            return Err(errno());
        }
        let mut api = Api {
            api: 0xAA,
            features: 0,
            ioctls: 0,
        };
        if libc::ioctl(fd, 0xc018_aa3f, &mut api) != 0 {
            return Err(errno());
        }
        let mut reg = Register {
            start: r.base as u64,
            len: (r.pages * PAGE) as u64,
            mode,
            ioctls: 0,
        };
        if libc::ioctl(fd, 0xc020_aa00, &mut reg) != 0 {
            return Err(errno());
        }
    }
    Ok(())
}

/// Whether region `r` is registered with a userfaultfd in write-protect mode (its VMA's
/// `uw` flag in /proc/self/smaps): rksm's, since this process registered none.
fn armed_by_another(r: Region) -> bool {
    let base = r.base as usize;
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return false;
    };
    let mut inside = false;
    for line in smaps.lines() {
        let range = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'));
        let bounds = range.and_then(|(a, b)| {
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        });
        if let Some((start, end)) = bounds {
            inside = (start..end).contains(&base);
        } else if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().any(|f| f == "uw");
            }
        }
    }
    false
}

fn run(line: &str, regions: &mut Vec<Region>) -> Result<String, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| -> Result<u64, String> {
        words
            .get(i)
            .ok_or_else(|| format!("missing argument {i}"))?
            .parse::<u64>()
            .map_err(|e| format!("argument {i}: {e}"))
    };
    let region = |id: u64| -> Result<Region, String> {
        regions
            .get(id as usize)
            .copied()
            .ok_or_else(|| format!("no region {id}"))
    };
    match words.first().copied() {
        Some("map") => {
            let at = match words.get(2) {
                Some(hex) => Some(
                    usize::from_str_radix(hex.trim_start_matches("0x"), 16)
                        .map_err(|e| format!("address: {e}"))?,
                ),
                None => None,
            };
            let r = Region::map(num(1)? as usize, at, false)?;
            let reply = format!("mapped {} {:#x}", regions.len(), r.base as usize);
            regions.push(r);
            Ok(reply)
        }
        Some("maphuge") => {
            let r = Region::map_huge(num(1)? as usize)?;
            let reply = format!("mapped {} {:#x}", regions.len(), r.base as usize);
            regions.push(r);
            Ok(reply)
        }
        Some("clearrefs") => {
            static CLEAR_REFS: std::sync::Mutex<Option<std::fs::File>> =
                std::sync::Mutex::new(None);
            let mut file = CLEAR_REFS.lock().map_err(|e| e.to_string())?;
            if file.is_none() {
                *file = Some(
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open("/proc/self/clear_refs")
                        .map_err(|e| format!("clear_refs: {e}"))?,
                );
            }
            file.as_mut()
                .expect("opened")
                .write_all(b"4")
                .map_err(|e| format!("clear_refs: {e}"))?;
            Ok("ok".into())
        }
        Some("softdirty") => {
            use std::os::unix::fs::FileExt;
            let r = region(num(1)?)?;
            let (first, count) = (num(2)? as usize, num(3)? as usize);
            r.page(first + count.max(1) - 1)?;
            let pagemap = std::fs::File::open("/proc/self/pagemap").map_err(|e| e.to_string())?;
            let mut raw = vec![0u8; count * 8];
            let start = r.page(first)? as u64 / PAGE as u64 * 8;
            pagemap
                .read_exact_at(&mut raw, start)
                .map_err(|e| e.to_string())?;
            let dirty = raw
                .chunks_exact(8)
                .filter(|e| u64::from_ne_bytes((*e).try_into().expect("8 bytes")) >> 55 & 1 == 1)
                .count();
            Ok(format!("softdirty {dirty}"))
        }
        Some("mapsparse") => {
            let r = Region::map(num(1)? as usize, None, true)?;
            let reply = format!("mapped {} {:#x}", regions.len(), r.base as usize);
            regions.push(r);
            Ok(reply)
        }
        Some("write") => {
            let r = region(num(1)?)?;
            let (first, count, seed) = (num(2)? as usize, num(3)? as usize, num(4)?);
            for p in first..first + count {
                let page = r.page(p)?;
                for w in 0..WORDS {
                    // SAFETY: w < WORDS keeps the write inside page `p` of the mapping.
                    unsafe { page.add(w).write_volatile(word(seed, w)) };
                }
            }
            Ok("ok".into())
        }
        Some("unique") => {
            let r = region(num(1)?)?;
            let (first, count, seed) = (num(2)? as usize, num(3)? as usize, num(4)?);
            for p in first..first + count {
                let page = r.page(p)?;
                for w in 0..WORDS {
                    // SAFETY: w < WORDS keeps the write inside page `p` of the mapping.
                    unsafe {
                        page.add(w)
                            .write_volatile(word(seed + (p - first) as u64, w))
                    };
                }
            }
            Ok("ok".into())
        }
        Some("alike") | Some("verifyalike") => {
            let verify = words.first() == Some(&"verifyalike");
            let kind = words.get(1).copied().unwrap_or("");
            let r = region(num(2)?)?;
            let (first, count, seed) = (num(3)? as usize, num(4)? as usize, num(5)?);
            for p in first..first + count {
                let page = r.page(p)?;
                for w in 0..WORDS {
                    let want = alike_word(kind, seed, p - first, w);
                    // SAFETY: w < WORDS keeps the access inside page `p` of the mapping.
                    unsafe {
                        match verify {
                            false => page.add(w).write_volatile(want),
                            true if page.add(w).read_volatile() != want => {
                                return Ok(format!("mismatch {p}"))
                            }
                            true => {}
                        }
                    }
                }
            }
            Ok("ok".into())
        }
        Some("fill") => {
            let r = region(num(1)?)?;
            let (first, count, byte) = (num(2)? as usize, num(3)? as usize, num(4)? as u8);
            let word = u64::from_ne_bytes([byte; 8]);
            for p in first..first + count {
                let page = r.page(p)?;
                for w in 0..WORDS {
                    // SAFETY: inside page `p` of the mapping.
                    unsafe { page.add(w).write_volatile(word) };
                }
            }
            Ok("ok".into())
        }
        Some("fork") => {
            // SAFETY: the child only sleeps until it is killed; it runs no Rust code that
            // could observe the parent's other threads (there are none).
            match unsafe { libc::fork() } {
                -1 => Err(format!("fork: {}", io::Error::last_os_error())),
                0 => {
                    // SAFETY: prctl and pause take no pointers.
                    unsafe {
                        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                        loop {
                            libc::pause();
                        }
                    }
                }
                pid => Ok(format!("forked {pid}")),
            }
        }
        Some("readinto") => {
            let r = region(num(1)?)?;
            let (first, count) = (num(2)? as usize, num(3)? as usize);
            let (path, how) = match (words.get(4), words.get(5)) {
                (Some(path), Some(how)) => (*path, *how),
                _ => return Err("readinto ID FIRST COUNT PATH read|direct|recv".into()),
            };
            if first + count > r.pages {
                return Err("outside the region".into());
            }
            let len = count * PAGE;
            let dst = r.page(first)?.cast::<libc::c_void>();
            let flags = if how == "direct" { libc::O_DIRECT } else { 0 };
            let file = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(path)
                .map_err(|e| format!("{path}: {e}"))?;
            use std::os::fd::AsRawFd;
            let got = match how {
                "read" | "direct" => {
                    // SAFETY: dst..dst+len lies inside the region (checked above).
                    unsafe { libc::read(file.as_raw_fd(), dst, len) }
                }
                "recv" => {
                    let (mine, theirs) = std::os::unix::net::UnixStream::pair()
                        .map_err(|e| format!("socketpair: {e}"))?;
                    let mut file = file;
                    let sender = std::thread::spawn(move || {
                        let mut theirs = theirs;
                        io::copy(&mut file, &mut theirs).map(|_| ())
                    });
                    // SAFETY: as above; MSG_WAITALL waits for all `len` bytes.
                    let got = unsafe { libc::recv(mine.as_raw_fd(), dst, len, libc::MSG_WAITALL) };
                    sender
                        .join()
                        .map_err(|_| "sender panicked".to_string())?
                        .map_err(|e| format!("send: {e}"))?;
                    got
                }
                other => return Err(format!("unknown way to read: {other}")),
            };
            if got != len as isize {
                return Err(format!(
                    "{how}: {got} of {len} bytes: {}",
                    io::Error::last_os_error()
                ));
            }
            Ok("ok".into())
        }
        Some("dontneed") => {
            let r = region(num(1)?)?;
            let (first, count) = (num(2)? as usize, num(3)? as usize);
            if first + count > r.pages {
                return Err("outside the region".into());
            }
            // SAFETY: the range lies inside the region; DONTNEED only drops its contents.
            if unsafe { libc::madvise(r.page(first)?.cast(), count * PAGE, libc::MADV_DONTNEED) }
                != 0
            {
                return Err(format!("madvise: {}", io::Error::last_os_error()));
            }
            Ok("ok".into())
        }
        Some("mergeable") => {
            let r = region(num(1)?)?;
            // SAFETY: the whole region, which this process mapped; MERGEABLE changes no byte.
            if unsafe { libc::madvise(r.page(0)?.cast(), r.pages * PAGE, libc::MADV_MERGEABLE) }
                != 0
            {
                return Err(format!("madvise: {}", io::Error::last_os_error()));
            }
            Ok("ok".into())
        }
        Some("unmergeable") => {
            let r = region(num(1)?)?;
            // SAFETY: as for MERGEABLE; UNMERGEABLE unmerges, which changes no byte either.
            if unsafe { libc::madvise(r.page(0)?.cast(), r.pages * PAGE, libc::MADV_UNMERGEABLE) }
                != 0
            {
                return Err(format!("madvise: {}", io::Error::last_os_error()));
            }
            Ok("ok".into())
        }
        Some("mremap") => {
            let (id, to) = (num(1)? as usize, num(2)? as usize);
            let (r, dest) = (region(id as u64)?, region(to as u64)?);
            if r.pages != dest.pages {
                return Err("regions of different sizes".into());
            }
            // SAFETY: moves this program's region onto another of its regions, which it
            // replaces (MREMAP_FIXED); neither address is used for anything else.
            let moved = unsafe {
                libc::mremap(
                    r.base.cast(),
                    r.pages * PAGE,
                    dest.pages * PAGE,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    dest.base.cast::<libc::c_void>(),
                )
            };
            if moved == libc::MAP_FAILED {
                return Err(format!("mremap: {}", io::Error::last_os_error()));
            }
            regions[id].base = moved.cast();
            Ok("ok".into())
        }
        Some("unmap") => {
            let r = region(num(1)?)?;
            // SAFETY: unmapping a region this program mapped; it is not used afterwards
            // (later commands on it fault in the child, which is the test's own doing).
            if unsafe { libc::munmap(r.base.cast(), r.pages * PAGE) } != 0 {
                return Err(format!("munmap: {}", io::Error::last_os_error()));
            }
            Ok("ok".into())
        }
        Some("threads") => {
            static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            for _ in 0..num(1)? {
                std::thread::spawn(|| loop {
                    COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    std::thread::sleep(std::time::Duration::from_micros(100));
                });
            }
            Ok(format!("threads {:#x}", COUNTER.as_ptr() as usize))
        }
        Some("rseq") => rseq_counter::run(num(1)?, num(2)? as usize, num(3)?),
        Some("epollstop") => {
            static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            extern "C" fn on_term(_: libc::c_int) {
                STOP.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            // SAFETY: a handler that only stores to an atomic; epoll_create1 returns a new fd
            // and the event buffer outlives each wait.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_term as *const () as usize;
                action.sa_flags = libc::SA_RESTART;
                if libc::sigaction(libc::SIGTERM, &action, std::ptr::null_mut()) != 0 {
                    return Err(format!("sigaction: {}", io::Error::last_os_error()));
                }
                let ep = libc::epoll_create1(0);
                let mut event = libc::epoll_event { events: 0, u64: 0 };
                let mut waits = 0u64;
                // The loop of a daemon that waits for events with no timeout and relies on
                // its SIGTERM handler's EINTR to notice that it must stop.
                while !STOP.load(std::sync::atomic::Ordering::SeqCst) {
                    libc::epoll_wait(ep, &mut event, 1, -1);
                    waits += 1;
                }
                libc::close(ep);
                Ok(format!("stopped after {waits} waits"))
            }
        }
        Some("sleep") => {
            std::thread::sleep(std::time::Duration::from_millis(num(1)?));
            Ok("slept".into())
        }
        Some("epoll") => {
            let ms = num(1)?;
            let timeout: i32 = words
                .get(2)
                .and_then(|w| w.parse().ok())
                .ok_or("epoll MS TIMEOUT")?;
            // SAFETY: plain fd-returning calls; the itimerspec and event are owned locals.
            unsafe {
                let ep = libc::epoll_create1(0);
                let timer = libc::timerfd_create(libc::CLOCK_MONOTONIC, 0);
                let mut when: libc::itimerspec = std::mem::zeroed();
                when.it_value.tv_sec = (ms / 1000) as i64;
                when.it_value.tv_nsec = ((ms % 1000) * 1_000_000) as i64;
                libc::timerfd_settime(timer, 0, &when, std::ptr::null_mut());
                let mut event = libc::epoll_event {
                    events: libc::EPOLLIN as u32,
                    u64: 1,
                };
                libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, timer, &mut event);
                let mut eintr = 0;
                let mut longest = std::time::Duration::ZERO;
                loop {
                    let entered = std::time::Instant::now();
                    let n = libc::epoll_wait(ep, &mut event, 1, timeout);
                    if n > 0 {
                        break;
                    }
                    if n == 0 {
                        longest = longest.max(entered.elapsed());
                    }
                    if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                        eintr += 1;
                    }
                }
                libc::close(timer);
                libc::close(ep);
                Ok(match words.get(3) {
                    Some(&"longest") => {
                        format!("epoll eintr {eintr} longest {}", longest.as_millis())
                    }
                    _ => format!("epoll eintr {eintr}"),
                })
            }
        }
        Some("signals") => {
            use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
            static NEXT: AtomicU64 = AtomicU64::new(0);
            static WRONG: AtomicU64 = AtomicU64::new(0);
            extern "C" fn take(_: i32, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
                // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
                let (code, value) =
                    unsafe { ((*info).si_code, (*info).si_value().sival_ptr as u64) };
                if code != libc::SI_QUEUE || value != NEXT.load(SeqCst) {
                    WRONG.fetch_add(1, SeqCst);
                }
                NEXT.fetch_add(1, SeqCst);
            }
            let n = num(1)?;
            // SAFETY: installs a handler that only touches atomics.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = take as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigaction(libc::SIGRTMIN(), &action, std::ptr::null_mut());
            }
            println!("listening");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while NEXT.load(SeqCst) < n && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            match (NEXT.load(SeqCst), WRONG.load(SeqCst)) {
                (got, 0) if got == n => Ok("signals ok".into()),
                (got, wrong) => Ok(format!("signals wrong {wrong} got {got} of {n}")),
            }
        }
        Some("vfork") => {
            // clone(CLONE_VM | CLONE_VFORK) on a stack of its own: the parent waits in the
            // kernel's vfork wait, as after vfork(2), without sharing its stack.
            extern "C" fn nap(ms: *mut libc::c_void) -> i32 {
                let ms = ms as u64;
                let pause = libc::timespec {
                    tv_sec: (ms / 1000) as i64,
                    tv_nsec: ((ms % 1000) * 1_000_000) as i64,
                };
                // SAFETY: nanosleep reads the timespec it is given.
                unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
                0
            }
            let mut stack = vec![0u8; 64 * 1024];
            // SAFETY: the child runs `nap` on `stack`, which outlives it (the parent cannot
            // return before the child exits, CLONE_VFORK); `nap` touches nothing shared.
            let child = unsafe {
                libc::clone(
                    nap,
                    stack.as_mut_ptr().add(stack.len()) as *mut libc::c_void,
                    libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                    num(1)? as usize as *mut libc::c_void,
                )
            };
            if child < 0 {
                return Err("clone failed".into());
            }
            // SAFETY: reaps the child just made.
            unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
            Ok("vforked".into())
        }
        Some("stat") => {
            let path = words.get(1).ok_or("stat PATH")?;
            Ok(match std::fs::metadata(path) {
                Ok(_) => "stat ok".into(),
                Err(e) => format!("stat error {e}"),
            })
        }
        Some("setuid") => {
            let uid = num(1)? as libc::uid_t;
            // SAFETY: setresuid and prctl with plain integers; this process only.
            unsafe {
                if libc::setresuid(uid, uid, uid) != 0
                    || libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) != 0
                {
                    return Err(format!("setuid: {}", io::Error::last_os_error()));
                }
            }
            Ok("ok".into())
        }
        Some("name") => {
            let name = std::ffi::CString::new(words.get(1).copied().unwrap_or(""))
                .map_err(|e| e.to_string())?;
            // SAFETY: PR_SET_NAME reads a NUL-terminated string (up to 16 bytes).
            match unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0) } {
                0 => Ok("ok".into()),
                _ => Err(format!("prctl: {}", io::Error::last_os_error())),
            }
        }
        Some("namehex") => {
            // A name of any bytes, as `prctl` allows: "ff78" is b"\xffx".
            let hex = words.get(1).copied().unwrap_or("");
            let bytes: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?;
            let name = std::ffi::CString::new(bytes).map_err(|e| e.to_string())?;
            // SAFETY: PR_SET_NAME reads a NUL-terminated string (up to 16 bytes).
            match unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0) } {
                0 => Ok("ok".into()),
                _ => Err(format!("prctl: {}", io::Error::last_os_error())),
            }
        }
        Some("nodump") => {
            // SAFETY: prctl with integer arguments.
            match unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } {
                0 => Ok("ok".into()),
                _ => Err(format!("prctl: {}", io::Error::last_os_error())),
            }
        }
        Some("setids") => {
            // SAFETY: setresuid with plain ids (-1 keeps one); this process only.
            match unsafe { libc::setresuid(u32::MAX, 65534, u32::MAX) } {
                0 => Ok("ok".into()),
                _ => Err(format!("setresuid: {}", io::Error::last_os_error())),
            }
        }
        Some("uffd") => {
            own_userfaultfd(region(num(1)?)?, "missing")
                .map_err(|e| format!("userfaultfd: {e}"))?;
            Ok("ok".into())
        }
        Some("ownuffd") => {
            let r = region(num(1)?)?;
            own_userfaultfd(r, words.get(2).copied().unwrap_or("wp"))
                .map(|()| "ownuffd ok".into())
                .or_else(|e| Ok(format!("ownuffd error {e}")))
        }
        Some("raceuffd") => {
            let r = region(num(1)?)?;
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(num(3)?);
            while !armed_by_another(r) {
                if std::time::Instant::now() > deadline {
                    return Ok("raceuffd notarmed".into());
                }
                std::thread::sleep(std::time::Duration::from_micros(500));
            }
            own_userfaultfd(r, words.get(2).copied().unwrap_or("wp"))
                .map(|()| "raceuffd ok".into())
                .or_else(|e| Ok(format!("raceuffd error {e}")))
        }
        Some("seccomp") => {
            let allow = [libc::sock_filter {
                code: (libc::BPF_RET | libc::BPF_K) as u16,
                jt: 0,
                jf: 0,
                k: libc::SECCOMP_RET_ALLOW,
            }];
            let prog = libc::sock_fprog {
                len: 1,
                filter: allow.as_ptr().cast_mut(),
            };
            // SAFETY: prctl with a valid filter program that outlives the call.
            let rc = unsafe {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &prog as *const libc::sock_fprog,
                )
            };
            if rc != 0 {
                return Err(format!("seccomp: {}", io::Error::last_os_error()));
            }
            Ok("ok".into())
        }
        Some("seccompworker") => {
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let filter = [
                    // The system call number.
                    libc::sock_filter {
                        code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
                        jt: 0,
                        jf: 0,
                        k: 0,
                    },
                    libc::sock_filter {
                        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
                        jt: 0,
                        jf: 1,
                        k: libc::SYS_madvise as u32,
                    },
                    libc::sock_filter {
                        code: (libc::BPF_RET | libc::BPF_K) as u16,
                        jt: 0,
                        jf: 0,
                        k: libc::SECCOMP_RET_KILL_PROCESS,
                    },
                    libc::sock_filter {
                        code: (libc::BPF_RET | libc::BPF_K) as u16,
                        jt: 0,
                        jf: 0,
                        k: libc::SECCOMP_RET_ALLOW,
                    },
                ];
                let prog = libc::sock_fprog {
                    len: filter.len() as u16,
                    filter: filter.as_ptr().cast_mut(),
                };
                // SAFETY: prctl with a valid filter program that outlives the call; it
                // applies to this thread only (no TSYNC).
                let rc = unsafe {
                    libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                    libc::prctl(
                        libc::PR_SET_SECCOMP,
                        libc::SECCOMP_MODE_FILTER,
                        &prog as *const libc::sock_fprog,
                    )
                };
                let _ = ready_tx.send(rc);
                let spins = std::sync::atomic::AtomicU64::new(0);
                loop {
                    spins.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            match ready_rx.recv() {
                Ok(0) => Ok("ok".into()),
                _ => Err(format!("seccomp: {}", io::Error::last_os_error())),
            }
        }
        Some("read") => {
            let r = region(num(1)?)?;
            let (first, count) = (num(2)? as usize, num(3)? as usize);
            let mut sum = 0u64;
            for p in first..first + count {
                // SAFETY: the first word of a page inside the mapping.
                sum = sum.wrapping_add(unsafe { r.page(p)?.read_volatile() });
            }
            Ok(format!("ok {sum}"))
        }
        Some("verifyunique") => {
            let r = region(num(1)?)?;
            let (first, count, seed) = (num(2)? as usize, num(3)? as usize, num(4)?);
            for p in first..first + count {
                let page = r.page(p)?;
                for w in 0..WORDS {
                    // SAFETY: inside page `p` of the mapping.
                    if unsafe { page.add(w).read_volatile() } != word(seed + (p - first) as u64, w)
                    {
                        return Ok(format!("mismatch {p}"));
                    }
                }
            }
            Ok("ok".into())
        }
        Some("verifyfill") => {
            let r = region(num(1)?)?;
            let (first, count, byte) = (num(2)? as usize, num(3)? as usize, num(4)? as u8);
            let expected = u64::from_ne_bytes([byte; 8]);
            for p in first..first + count {
                let page = r.page(p)?;
                for w in 0..WORDS {
                    // SAFETY: inside page `p` of the mapping.
                    if unsafe { page.add(w).read_volatile() } != expected {
                        return Ok(format!("mismatch {p}"));
                    }
                }
            }
            Ok("ok".into())
        }
        Some("verify") => {
            let r = region(num(1)?)?;
            let (first, count, seed) = (num(2)? as usize, num(3)? as usize, num(4)?);
            for p in first..first + count {
                let page = r.page(p)?;
                for w in 0..WORDS {
                    // SAFETY: inside page `p` of the mapping.
                    if unsafe { page.add(w).read_volatile() } != word(seed, w) {
                        return Ok(format!("mismatch {p}"));
                    }
                }
            }
            Ok("ok".into())
        }
        Some("pid") => Ok(format!("pid {}", std::process::id())),
        Some("exec") => {
            use std::os::unix::process::CommandExt;
            println!("ok");
            let err = std::process::Command::new("/proc/self/exe").exec();
            Err(format!("exec: {err}"))
        }
        Some("exit") => std::process::exit(0),
        _ => Err(format!("unknown command `{line}`")),
    }
}

fn main() {
    let mut regions = Vec::new();
    // `rksm-testchild 'CMD; CMD...'`: runs the commands, then sleeps until killed, holding
    // no pipe (for tests with thousands of children).
    if let Some(script) = std::env::args().nth(1) {
        for line in script.split(';') {
            if let Err(e) = run(line.trim(), &mut regions) {
                eprintln!("rksm-testchild: {line}: {e}");
                std::process::exit(1);
            }
        }
        loop {
            // SAFETY: pause has no arguments; it returns only when a handled signal
            // arrives.
            unsafe { libc::pause() };
        }
    }
    let stdin = io::stdin();
    let mut stdout = io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let reply = run(&line, &mut regions).unwrap_or_else(|e| format!("error {e}"));
        if writeln!(stdout, "{reply}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            break;
        }
    }
}
