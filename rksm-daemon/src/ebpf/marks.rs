//! The mark watch: every process that asked the kernel to make memory mergeable.
//!
//! A process outside the targets that marks its memory mergeable can probe, through ksmd,
//! the pages rksm marks in another domain. The daemon looks for such processes in /proc
//! (their `ksm_stat`) once a pass; one that marks its memory, reads what ksmd did and
//! unmarks it again between two looks would not be seen there. Two programs (rksm-ebpf's
//! `marks`) on the entries of `madvise` and `prctl` record every process that asks for
//! `MADV_MERGEABLE` or `PR_SET_MEMORY_MERGE`, and the daemon takes the record at each look,
//! so no such call escapes it while rksm runs. A process that inherited the flag (a child of
//! one that set `PR_SET_MEMORY_MERGE`) made no call: the look at /proc finds it.

use std::{collections::HashSet, sync::Mutex};

use aya::{
    maps::{HashMap as BpfHashMap, MapData},
    Ebpf,
};
use rksm_common::marks::{
    MADVISE_BEHAVIOR_OFFSET, MARKERS, PRCTL_ARG2_OFFSET, PRCTL_OPTION_OFFSET, PROGRAMS,
};

use crate::ebpf::{guard::GuardError, tracefs, tracer::EBPF_OBJECT};

/// The loaded watch.
pub struct MarkWatch {
    /// An LRU hash map, which aya reads as a hash map.
    markers: Mutex<BpfHashMap<MapData, u32, u64>>,
    // Holds the programs and their links.
    _ebpf: Mutex<Ebpf>,
}

impl MarkWatch {
    /// Loads and attaches the watch; it records from now on, until dropped.
    pub fn load(object: &mut super::Object) -> Result<Self, GuardError> {
        if EBPF_OBJECT.is_empty() {
            return Err(GuardError::NotBuiltIn);
        }
        let tracefs = tracefs::ensure_mounted()?;
        for (event, name, offset) in [
            ("sys_enter_madvise", "behavior", MADVISE_BEHAVIOR_OFFSET),
            ("sys_enter_prctl", "option", PRCTL_OPTION_OFFSET),
            ("sys_enter_prctl", "arg2", PRCTL_ARG2_OFFSET),
        ] {
            super::check_syscall_field(tracefs, event, name, offset)?;
        }
        let mut ebpf = object.load(&[MARKERS], &[])?;
        super::attach_syscall_programs(&mut ebpf, &PROGRAMS)?;
        let map = ebpf.take_map(MARKERS).ok_or(GuardError::Missing(MARKERS))?;
        let markers = BpfHashMap::try_from(map).map_err(|e| GuardError::Map(MARKERS, e))?;
        Ok(MarkWatch {
            markers: Mutex::new(markers),
            _ebpf: Mutex::new(ebpf),
        })
    }

    /// The processes that asked to make memory mergeable since the last take, and forgets
    /// them.
    pub fn take(&self) -> HashSet<u32> {
        let mut markers = self.markers.lock().unwrap_or_else(|e| e.into_inner());
        let pids: HashSet<u32> = markers.keys().flatten().collect();
        for pid in &pids {
            let _ = markers.remove(pid);
        }
        pids
    }
}
