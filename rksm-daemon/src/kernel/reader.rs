//! Reading target memory: `process_vm_readv` in batches, /proc/PID/mem where pinning hurts.
//!
//! `process_vm_readv` reads a batch of up to 1024 runs of contiguous pages in one system call,
//! straight into a buffer of ours, with no ptrace stop. But it *pins* the pages it reads
//! (FOLL_PIN), and since Linux 5.19 pinning an anonymous page that is mapped more than once
//! makes the kernel give the target a private copy first (`gup_must_unshare`): reading a KSM
//! page or a page shared with a forked child that way would undo the very sharing rksm is
//! after. So pages mapped once (pagemap's exclusive bit) go through `process_vm_readv`, and
//! pages mapped more than once through /proc/PID/mem, whose reads take a plain reference and
//! leave sharing alone. Either way nothing is written to the target.
//!
//! Memory can vanish under the read (the target unmaps it or exits); the kernel then returns a
//! short count, and this module reports exactly which pages were read, so the caller never
//! hashes stale bytes.

use std::{fs::File, io::IoSliceMut, os::unix::fs::FileExt};

use nix::{
    errno::Errno,
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::Pid,
};
use rksm_common::PAGE;

/// The kernel's UIO_MAXIOV: at most this many remote runs per call.
const MAX_RUNS: usize = 1024;

/// Errors reading another process's memory.
#[derive(Debug, thiserror::Error)]
pub enum ReaderError {
    /// The process exited.
    #[error("process {0} has exited")]
    Gone(u32),
    /// The kernel refused the read (no permission to ptrace-read the process).
    #[error("reading the memory of process {pid}: {errno}")]
    Denied {
        /// The process.
        pid: u32,
        /// What the kernel said.
        errno: Errno,
    },
}

/// An open /proc/PID/mem, for pages that must not be pinned.
#[derive(Debug)]
pub struct ProcMem {
    pid: u32,
    file: File,
}

impl ProcMem {
    /// Opens /proc/PID/mem (needs ptrace access to the process: root).
    pub fn open(pid: u32) -> Result<Self, ReaderError> {
        match File::open(format!("/proc/{pid}/mem")) {
            Ok(file) => Ok(ProcMem { pid, file }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ReaderError::Gone(pid)),
            Err(e) => Err(ReaderError::Denied {
                pid,
                errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
            }),
        }
    }

    /// Reads the page at `addr` into `buf`; false if it is not mapped (or the process exited).
    pub fn read_page(&self, addr: u64, buf: &mut [u8]) -> bool {
        matches!(self.file.read_at(&mut buf[..PAGE], addr), Ok(PAGE))
    }

    /// Whether the address space this file was opened on is still the process's, asked by
    /// reading one byte at `addr`: once the process executed another program the file reads
    /// nothing at all (`Some(false)`); `None` if `addr` is not mapped any more.
    pub fn same_space(&self, addr: u64) -> Option<bool> {
        let mut byte = [0u8; 1];
        match self.file.read_at(&mut byte, addr) {
            Ok(0) => Some(false),
            Ok(_) => Some(true),
            Err(_) => None,
        }
    }

    /// Reads `buf.len()` bytes at `addr`; false unless all of them were read.
    pub fn read_at(&self, addr: u64, buf: &mut [u8]) -> bool {
        self.file.read_exact_at(buf, addr).is_ok()
    }
}

/// Reads `addrs` (page-aligned) of the process behind `mem` into `out`, page `i` at
/// `out[i * 4096..]`, and sets `read[i]` for every page read in full; pages that vanished are
/// left unset. Only the address space `mem` was opened on is read: once the process has
/// executed another program, nothing is, and the process counts as gone. Pages with
/// `mapped_once[i]` are read in batches with `process_vm_readv`; the
/// others one by one through /proc/PID/mem, so that reading never unshares them. Returns how
/// many pages were read.
pub fn read_pages(
    mem: &ProcMem,
    addrs: &[u64],
    mapped_once: &[bool],
    out: &mut [u8],
    read: &mut [bool],
) -> Result<usize, ReaderError> {
    assert!(
        out.len() >= addrs.len() * PAGE
            && read.len() >= addrs.len()
            && mapped_once.len() >= addrs.len()
    );
    let mut done = 0;
    let mut i = 0;
    while i < addrs.len() {
        // The longest stretch starting at i with one reading method.
        let pinnable = mapped_once[i];
        let end = (i..addrs.len())
            .find(|&j| mapped_once[j] != pinnable)
            .unwrap_or(addrs.len());
        if pinnable {
            let n = vm_readv(
                mem.pid,
                &addrs[i..end],
                &mut out[i * PAGE..end * PAGE],
                &mut read[i..end],
            )?;
            // process_vm_readv reads whatever the pid runs now; /proc/PID/mem, the address
            // space it was opened on. A page the former just read that the latter can still
            // read proves both are the same: the process has not executed another program
            // (a set-id one, perhaps) since `mem` was opened, and what was read is its.
            match (i..end)
                .find(|&j| read[j])
                .map(|j| mem.same_space(addrs[j]))
            {
                Some(Some(false)) => {
                    read[i..end].fill(false);
                    return Err(ReaderError::Gone(mem.pid));
                }
                // Unmapped meanwhile: which address space was read cannot be told; nothing
                // of this stretch is used (it is read again next pass).
                Some(None) => read[i..end].fill(false),
                _ => done += n,
            }
        } else {
            for j in i..end {
                read[j] = mem.read_page(addrs[j], &mut out[j * PAGE..(j + 1) * PAGE]);
                done += usize::from(read[j]);
            }
        }
        i = end;
    }
    Ok(done)
}

/// `process_vm_readv` in batches: for pages mapped exactly once only (see the module docs).
fn vm_readv(
    pid: u32,
    addrs: &[u64],
    out: &mut [u8],
    read: &mut [bool],
) -> Result<usize, ReaderError> {
    read[..addrs.len()].fill(false);
    let mut done = 0;
    let mut first = 0;
    while first < addrs.len() {
        // Runs of contiguous addresses from `first`, at most MAX_RUNS of them.
        let mut runs: Vec<RemoteIoVec> = Vec::with_capacity(16);
        let mut last = first;
        while last < addrs.len() {
            let addr = addrs[last];
            let full = runs.len() == MAX_RUNS;
            match runs.last_mut() {
                Some(run) if run.base as u64 + run.len as u64 == addr => run.len += PAGE,
                _ if full => break,
                _ => runs.push(RemoteIoVec {
                    base: addr as usize,
                    len: PAGE,
                }),
            }
            last += 1;
        }
        let bytes = &mut out[first * PAGE..last * PAGE];
        let n = match process_vm_readv(
            Pid::from_raw(pid as i32),
            &mut [IoSliceMut::new(bytes)],
            &runs,
        ) {
            Ok(n) => n,
            Err(Errno::ESRCH) => return Err(ReaderError::Gone(pid)),
            // The first page is not mapped any more: skip it, go on with the rest.
            Err(Errno::EFAULT) => 0,
            Err(errno) => return Err(ReaderError::Denied { pid, errno }),
        };
        let full = n / PAGE;
        read[first..first + full].fill(true);
        done += full;
        // A short read stops at the first page that could not be read: skip it.
        first += if first + full < last { full + 1 } else { full };
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_addr(buf: &[u8], index: usize) -> u64 {
        buf[index * PAGE..].as_ptr() as u64
    }

    #[test]
    fn reads_runs_and_scattered_pages_of_a_process() {
        // Our own memory is a fine target: process_vm_readv on ourselves needs no privilege.
        let mut source = vec![0u8; 9 * PAGE];
        let base = source.as_ptr().align_offset(PAGE);
        for i in 0..8 {
            source[base + i * PAGE..base + (i + 1) * PAGE].fill(i as u8 + 1);
        }
        let aligned = &source[base..base + 8 * PAGE];
        let addrs = [
            page_addr(aligned, 0),
            page_addr(aligned, 1),
            page_addr(aligned, 5),
            page_addr(aligned, 3),
        ];
        let mem = ProcMem::open(std::process::id()).unwrap();
        for mapped_once in [[true; 4], [false; 4], [true, false, false, true]] {
            let mut out = vec![0u8; addrs.len() * PAGE];
            let mut read = vec![false; addrs.len()];
            assert_eq!(
                read_pages(&mem, &addrs, &mapped_once, &mut out, &mut read).unwrap(),
                4
            );
            assert_eq!(read, [true; 4]);
            for (i, expect) in [1u8, 2, 6, 4].into_iter().enumerate() {
                assert!(
                    out[i * PAGE..(i + 1) * PAGE].iter().all(|&b| b == expect),
                    "{mapped_once:?} page {i}"
                );
            }
        }
        let mut out = vec![0u8; addrs.len() * PAGE];
        let mut read = vec![false; addrs.len()];
        assert_eq!(
            vm_readv(std::process::id(), &addrs, &mut out, &mut read).unwrap(),
            4
        );
        for (i, expect) in [1u8, 2, 6, 4].into_iter().enumerate() {
            assert!(
                out[i * PAGE..(i + 1) * PAGE].iter().all(|&b| b == expect),
                "page {i}"
            );
        }
    }

    #[test]
    fn an_unmapped_page_is_skipped_and_the_rest_is_read() {
        // SAFETY: a fresh anonymous mapping of three pages; the middle one is unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                3 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let base = map as u64;
        // SAFETY: the three pages are ours; the middle one is then unmapped and never touched.
        unsafe {
            std::ptr::write_bytes(map.cast::<u8>(), 9, 3 * PAGE);
            assert_eq!(libc::munmap(map.cast::<u8>().add(PAGE).cast(), PAGE), 0);
        }
        let addrs = [base, base + PAGE as u64, base + 2 * PAGE as u64];
        let mem = ProcMem::open(std::process::id()).unwrap();
        for mapped_once in [[true; 3], [false; 3]] {
            let mut out = vec![0u8; 3 * PAGE];
            let mut read = vec![false; 3];
            assert_eq!(
                read_pages(&mem, &addrs, &mapped_once, &mut out, &mut read).unwrap(),
                2
            );
            assert_eq!(read, [true, false, true], "{mapped_once:?}");
            assert!(out[2 * PAGE..].iter().all(|&b| b == 9));
        }
        // SAFETY: unmapping the two pages still mapped.
        unsafe {
            libc::munmap(map, PAGE);
            libc::munmap(map.cast::<u8>().add(2 * PAGE).cast(), PAGE);
        }
    }

    #[test]
    fn a_missing_process_is_gone() {
        let mut out = vec![0u8; PAGE];
        let mut read = [false];
        let err = vm_readv(4_194_305, &[0x1000], &mut out, &mut read).unwrap_err();
        assert!(matches!(err, ReaderError::Gone(4_194_305)), "{err}");
        assert!(matches!(
            ProcMem::open(4_194_305),
            Err(ReaderError::Gone(4_194_305))
        ));
    }
}
