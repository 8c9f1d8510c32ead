//! The open-file limit.
//!
//! rksm holds a few files per target for as long as it works on it (the pidfd that pins the
//! process; with userfaultfd write protection, the userfaultfd and the pagemap it is scanned
//! through) and a few more while a pass reads it. The soft limit every service gets by
//! default, 1024, would cap it at a few hundred targets, so it raises its soft limit to the
//! hard one at start, as a program that does not use `select(2)` may. Running out all the
//! same (a low hard limit, the system-wide limit) is a passing condition: the target is
//! left for a pass and taken up again, never refused.

use std::{io, os::fd::BorrowedFd};

/// Files kept free for passes when a target is armed: what a pass holds open while it reads
/// its group of targets, and a margin for the status server and ksmd's files.
pub const PASS_RESERVE: usize = 160;

/// The soft and hard limits on open files, before and after raising the soft one to the
/// hard one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFiles {
    /// The soft limit found at start.
    pub was: u64,
    /// The soft limit now (the hard limit, if it could be raised).
    pub now: u64,
}

/// The soft and hard limits on open files.
fn nofile() -> io::Result<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct it is given.
    match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } {
        0 => Ok(limit),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Raises the soft limit on open files to the hard limit.
pub fn raise_open_files() -> io::Result<OpenFiles> {
    let mut limit = nofile()?;
    let was = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: setrlimit reads one rlimit; a soft limit up to the hard one is always
        // allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(OpenFiles {
        was,
        now: limit.rlim_cur,
    })
}

/// The soft limit on open files now.
pub fn open_files_limit() -> u64 {
    nofile().map_or(0, |limit| limit.rlim_cur)
}

/// Whether `n` more files can be opened now, tried by duplicating `fd` `n` times (the
/// duplicates are closed again at once).
pub fn room_for(fd: BorrowedFd<'_>, n: usize) -> bool {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        match fd.try_clone_to_owned() {
            Ok(dup) => held.push(dup),
            Err(_) => return false,
        }
    }
    true
}

/// Whether `e` says rksm (EMFILE) or the system (ENFILE) has no file descriptor left: a
/// condition that passes, not a property of the target.
pub fn out_of_files(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let raised = raise_open_files().unwrap();
        assert!(raised.now >= raised.was);
        assert_eq!(open_files_limit(), raised.now);
        let limit = nofile().unwrap();
        assert_eq!(limit.rlim_cur, limit.rlim_max);
    }

    #[test]
    fn room_is_what_can_still_be_opened() {
        use std::os::fd::AsFd;
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(room_for(file.as_fd(), 8));
        // More than the limit allows, whatever is open already.
        assert!(!room_for(file.as_fd(), open_files_limit() as usize + 1));
    }

    #[test]
    fn running_out_of_files_is_told_apart() {
        assert!(out_of_files(&io::Error::from_raw_os_error(libc::EMFILE)));
        assert!(out_of_files(&io::Error::from_raw_os_error(libc::ENFILE)));
        assert!(!out_of_files(&io::Error::from_raw_os_error(libc::EACCES)));
        assert!(!out_of_files(&io::Error::other("no errno")));
    }
}
