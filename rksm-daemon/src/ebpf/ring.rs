//! The tracer's record ring, read through one mapping of its pages.
//!
//! A BPF ring's reader maps its data pages twice in a row, so that a record that wraps past
//! the end reads as one piece; aya's and libbpf's readers do. The kernel fills both mappings
//! when they are made, so every page of the ring counts twice in the daemon's resident
//! memory: the ring's 4 MiB would be 8 MiB of it. This reader maps the data once and copies
//! a record that wraps (one of the few that straddle the end) in two pieces: a record is a
//! few bytes, and the daemon copies each one out anyway.
//!
//! The protocol is the kernel's (`kernel/bpf/ringbuf.c`): the producer's position on the
//! page after the consumer's, then the data; each record an 8-byte header whose length word
//! the kernel commits last, with a busy bit while it writes and a discard bit for a record
//! given up, the next record 8-byte aligned after it.

use std::{
    os::fd::{AsFd, BorrowedFd},
    ptr::NonNull,
    sync::atomic::{fence, AtomicU32, AtomicU64, Ordering},
};

use aya::maps::MapData;
use rksm_common::PAGE_SIZE;

const BUSY: u32 = 1 << 31;
const DISCARD: u32 = 1 << 30;
const HEADER: u64 = 8;

/// One mapping of the ring's file, unmapped when dropped.
#[derive(Debug)]
struct Mapping {
    at: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(
        fd: BorrowedFd<'_>,
        len: usize,
        prot: libc::c_int,
        offset: u64,
    ) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a new shared mapping of the ring's fd, at an address the kernel picks; it
        // aliases no Rust object, and it is unmapped only by Drop.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let at = NonNull::new(at.cast()).ok_or_else(|| std::io::Error::other("mmap gave 0"))?;
        Ok(Mapping { at, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `len` bytes, unmapped once; no reference into
        // it outlives the `Ring` that owns it.
        unsafe {
            libc::munmap(self.at.as_ptr().cast(), self.len);
        }
    }
}

/// A BPF ring of records, read from one mapping of its data.
#[derive(Debug)]
pub struct Ring {
    /// The consumer's page: its position, which the reader publishes.
    consumer: Mapping,
    /// The producer's page, then the data once.
    producer: Mapping,
    /// Bytes of data, a power of two.
    size: u64,
    /// The consumer's position, as last published.
    pos: u64,
    // Declared last: the mappings above go before the map's fd is closed.
    map: MapData,
}

// SAFETY: the mappings are owned by the ring and only read or written through `&mut self`
// (or read, for the producer's position, which the kernel writes atomically).
unsafe impl Send for Ring {}

impl Ring {
    /// Maps `map`, a ring of `size` bytes of data (a power of two, a multiple of the page
    /// size), to read it from where its reader left it.
    pub fn new(map: MapData, size: u32) -> std::io::Result<Ring> {
        let size = u64::from(size);
        if !size.is_power_of_two() || size < PAGE_SIZE {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        let fd = map.fd().as_fd();
        let page = PAGE_SIZE as usize;
        let consumer = Mapping::new(fd, page, libc::PROT_READ | libc::PROT_WRITE, 0)?;
        let producer = Mapping::new(fd, page + size as usize, libc::PROT_READ, PAGE_SIZE)?;
        let mut ring = Ring {
            consumer,
            producer,
            size,
            pos: 0,
            map,
        };
        ring.pos = ring.consumer_pos().load(Ordering::Acquire);
        Ok(ring)
    }

    fn consumer_pos(&self) -> &AtomicU64 {
        // SAFETY: the consumer's page starts with its position, an aligned u64 that only
        // this reader writes; the page lives as long as `self`.
        unsafe { self.consumer.at.cast::<AtomicU64>().as_ref() }
    }

    fn producer_pos(&self) -> u64 {
        // SAFETY: the producer's page starts with its position, an aligned u64 the kernel
        // stores with release semantics; read-only here, and mapped as long as `self`.
        unsafe { self.producer.at.cast::<AtomicU64>().as_ref() }.load(Ordering::Acquire)
    }

    /// The data byte at `offset` (below `size`).
    fn data(&self, offset: u64) -> *const u8 {
        debug_assert!(offset < self.size);
        // SAFETY: the data follows the producer's page and holds `size` bytes; `offset` is
        // masked below it by every caller.
        unsafe {
            self.producer
                .at
                .as_ptr()
                .add(PAGE_SIZE as usize + offset as usize)
        }
    }

    /// Copies `out.len()` bytes from the data at `offset`, wrapping past its end.
    fn copy_from(&self, offset: u64, out: &mut [u8]) {
        let first = out.len().min((self.size - offset) as usize);
        let (head, tail) = out.split_at_mut(first);
        // SAFETY: `first` bytes from `offset` and the rest from the data's start are inside
        // the mapping (`out` is no longer than the record, which the kernel keeps within the
        // ring); the ranges do not overlap `out`, a buffer of the daemon's.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data(offset), head.as_mut_ptr(), head.len());
            std::ptr::copy_nonoverlapping(self.data(0), tail.as_mut_ptr(), tail.len());
        }
    }

    /// Hands every committed record now in the ring to `each`, in order (its bytes, the
    /// first `N` of a longer one), and frees its room. Stops at a record the kernel is still
    /// writing.
    pub fn drain<const N: usize>(&mut self, mut each: impl FnMut(&[u8])) {
        let mask = self.size - 1;
        // Set once a position was published: before giving up on an empty ring or a record
        // in writing, a full barrier, so that either the kernel's next commit sees the
        // position (and wakes a poller by the ring's rule) or the look after it sees the
        // record.
        let mut fence_due = false;
        loop {
            let len_word = if self.pos == self.producer_pos() {
                None
            } else {
                let header = self.data(self.pos & mask).cast::<AtomicU32>();
                // SAFETY: a record's header is 8-byte aligned inside the data, never wrapped;
                // the kernel commits its length word with a full barrier, paired with this
                // acquire.
                Some(unsafe { &*header }.load(Ordering::Acquire))
            };
            let len_word = match len_word {
                Some(word) if word & BUSY == 0 => word,
                _ if fence_due => {
                    fence(Ordering::SeqCst);
                    fence_due = false;
                    continue;
                }
                _ => return,
            };
            let len = u64::from(len_word & !(BUSY | DISCARD));
            if len > self.size - HEADER {
                // Not a record the kernel could have written; nothing after it can be read.
                log::error!("the tracer's ring holds a record of {len} bytes; reading stops");
                return;
            }
            if len_word & DISCARD == 0 {
                let mut out = [0u8; N];
                let take = (len as usize).min(N);
                self.copy_from((self.pos + HEADER) & mask, &mut out[..take]);
                each(&out[..take]);
            }
            self.pos += (len + HEADER).next_multiple_of(8);
            // Room is given back record by record, as the kernel's readers do: a ring drained
            // while it fills makes room at once.
            self.consumer_pos().store(self.pos, Ordering::Release);
            fence_due = true;
        }
    }
}

impl AsFd for Ring {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.map.fd().as_fd()
    }
}
