//! The wait watch: when a target's thread entered the `epoll_wait` a borrow cut short.
//!
//! The kernel does not restart `epoll_wait` when it is interrupted: it returns EINTR, and a
//! borrow's interrupt is an interruption like a signal's. rksm enters the wait again for the
//! thread, and for a wait with a timeout it must do so with the time the wait had left, as
//! the kernel does for the timed calls it restarts itself (`nanosleep`, `poll`): otherwise a
//! loop that waits 50 ms between its timers would wait longer. The time left is the timeout
//! less the time since the thread entered the call, which only the kernel saw: two programs
//! (rksm-ebpf's `waits`) record it for the threads of the processes watched, and the borrow
//! asks for it ([`crate::kernel::remote::set_call_entry`]).
//!
//! Process-wide like the guard: [`install`] once; the daemon watches each target it adopts.

use std::sync::{Mutex, OnceLock};

use aya::{
    maps::{HashMap as BpfHashMap, MapData},
    Ebpf,
};
use rksm_common::waits::{ENTERED, PROGRAMS, WAITERS};

use crate::{
    ebpf::{guard::GuardError, tracefs, tracer::EBPF_OBJECT},
    kernel::remote,
};

/// The loaded watch.
pub struct WaitWatch {
    waiters: Mutex<BpfHashMap<MapData, u32, u64>>,
    /// An LRU hash map, which aya reads as a hash map.
    entered: BpfHashMap<MapData, u32, u64>,
    // Holds the programs and their links.
    _ebpf: Mutex<Ebpf>,
}

static WATCH: OnceLock<WaitWatch> = OnceLock::new();

/// Loads and attaches the watch once per process, and makes it the borrow's source of entry
/// times.
pub fn install(object: &mut super::Object) -> Result<&'static WaitWatch, GuardError> {
    if let Some(watch) = WATCH.get() {
        return Ok(watch);
    }
    let watch = WaitWatch::load(object)?;
    let watch = WATCH.get_or_init(|| watch);
    remote::set_call_entry(entered);
    Ok(watch)
}

/// The watch, if [`install`] succeeded.
pub fn installed() -> Option<&'static WaitWatch> {
    WATCH.get()
}

/// When thread `tid` of process `pid` entered its latest watched wait.
fn entered(pid: u32, tid: u32) -> Option<u64> {
    installed()?.entered(pid, tid)
}

impl WaitWatch {
    fn load(object: &mut super::Object) -> Result<Self, GuardError> {
        if EBPF_OBJECT.is_empty() {
            return Err(GuardError::NotBuiltIn);
        }
        tracefs::ensure_mounted()?;
        let mut ebpf = object.load(&[WAITERS, ENTERED], &[])?;
        super::attach_syscall_programs(&mut ebpf, &PROGRAMS)?;
        let take = |ebpf: &mut Ebpf, name| ebpf.take_map(name).ok_or(GuardError::Missing(name));
        let waiters = BpfHashMap::try_from(take(&mut ebpf, WAITERS)?)
            .map_err(|e| GuardError::Map(WAITERS, e))?;
        let entered = BpfHashMap::try_from(take(&mut ebpf, ENTERED)?)
            .map_err(|e| GuardError::Map(ENTERED, e))?;
        Ok(WaitWatch {
            waiters: Mutex::new(waiters),
            entered,
            _ebpf: Mutex::new(ebpf),
        })
    }

    /// Records the entry times of `pid`'s threads from now on.
    pub fn watch(&self, pid: u32) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = waiters.insert(pid, remote::monotonic_ns(), 0) {
            log::debug!("pid {pid}: its waits are not watched: {e}");
        }
    }

    /// Stops recording for `pid` (it is no longer a target).
    pub fn unwatch(&self, pid: u32) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let _ = waiters.remove(&pid);
    }

    /// When thread `tid` of `pid` entered its latest watched wait; `None` if it has not since
    /// `pid` was watched (an entry older than that is another process's thread, or a wait
    /// entered before rksm looked).
    fn entered(&self, pid: u32, tid: u32) -> Option<u64> {
        let added = {
            let waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
            waiters.get(&pid, 0).ok()?
        };
        let at = self.entered.get(&tid, 0).ok()?;
        (at >= added).then_some(at)
    }
}
