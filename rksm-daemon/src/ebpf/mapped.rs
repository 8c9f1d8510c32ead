//! An array map's values mapped into the daemon (`BPF_F_MMAPABLE`), for the programs the
//! daemon runs on demand: it writes a job's input there and reads the output back, with no
//! copy of either through a system call. A program touches the values only while the daemon
//! waits in `BPF_PROG_TEST_RUN`, so the two never touch them at once.

use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
};

use aya::{
    maps::{Map, MapData},
    Ebpf,
};

/// Errors mapping an array.
#[derive(Debug, thiserror::Error)]
pub enum MappedError {
    /// The object has no such map.
    #[error("the eBPF object has no map {0}")]
    Missing(&'static str),
    /// The map is not an array.
    #[error("the map {0} is not an array")]
    NotArray(&'static str),
    /// The kernel refused the mapping.
    #[error("mapping {0}: {1}")]
    Mmap(&'static str, std::io::Error),
}

/// The values of one array map, `len` bytes from `addr`.
pub(super) struct MappedArray {
    addr: NonNull<u8>,
    len: usize,
    /// The map, whose fd stays open as long as it is mapped.
    _map: MapData,
}

impl MappedArray {
    /// Takes map `name` out of `ebpf` and maps its first `bytes` bytes (rounded up to a page).
    pub(super) fn take(
        ebpf: &mut Ebpf,
        name: &'static str,
        bytes: usize,
    ) -> Result<Self, MappedError> {
        let Map::Array(map) = ebpf.take_map(name).ok_or(MappedError::Missing(name))? else {
            return Err(MappedError::NotArray(name));
        };
        let len = bytes.next_multiple_of(rksm_common::PAGE);
        // SAFETY: maps the array's values (offset 0) of an fd that stays open in `_map`;
        // the kernel checks the length against the map and its BPF_F_MMAPABLE flag.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(MappedError::Mmap(name, std::io::Error::last_os_error()));
        }
        let addr = NonNull::new(addr.cast())
            .ok_or_else(|| MappedError::Mmap(name, std::io::Error::other("mmap gave 0")))?;
        Ok(MappedArray {
            addr,
            len,
            _map: map,
        })
    }

    /// The start of the values.
    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.addr.as_ptr()
    }
}

impl Drop for MappedArray {
    fn drop(&mut self) {
        // SAFETY: the mapping made in take, not used after this.
        unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
    }
}
