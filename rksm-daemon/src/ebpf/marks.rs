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
    programs::TracePoint,
    Ebpf,
};
use rksm_common::marks::{
    CATEGORY, MADVISE_BEHAVIOR_OFFSET, MARKERS, PRCTL_ARG2_OFFSET, PRCTL_OPTION_OFFSET, PROGRAMS,
};

use crate::ebpf::{guard::GuardError, tracefs, tracer::EBPF_OBJECT};

/// The loaded watch.
pub struct MarkWatch {
    /// An LRU hash map, which aya reads as a hash map.
    markers: Mutex<BpfHashMap<MapData, u32, u64>>,
    // Holds the programs and their links.
    _ebpf: Mutex<Ebpf>,
}

/// Checks that the tracepoints have their fields where the programs read them.
fn check_layout(tracefs: &std::path::Path) -> Result<(), GuardError> {
    let fields = [
        ("sys_enter_madvise", "behavior", MADVISE_BEHAVIOR_OFFSET),
        ("sys_enter_prctl", "option", PRCTL_OPTION_OFFSET),
        ("sys_enter_prctl", "arg2", PRCTL_ARG2_OFFSET),
    ];
    for (event, name, offset) in fields {
        let path = tracefs.join(format!("events/{CATEGORY}/{event}/format"));
        let text = std::fs::read_to_string(&path).map_err(|e| {
            GuardError::Layout(format!(
                "cannot read {}: {e} (a kernel without syscall tracepoints)",
                path.display()
            ))
        })?;
        match tracefs::parse_format(&text).iter().find(|f| f.name == name) {
            Some(f) if f.offset == offset => {}
            Some(f) => {
                return Err(GuardError::Layout(format!(
                    "{CATEGORY}:{event} has `{name}` at offset {}, the program reads {offset}",
                    f.offset
                )))
            }
            None => {
                return Err(GuardError::Layout(format!(
                    "{CATEGORY}:{event} has no field `{name}`"
                )))
            }
        }
    }
    Ok(())
}

impl MarkWatch {
    /// Loads and attaches the watch; it records from now on, until dropped.
    pub fn load() -> Result<Self, GuardError> {
        if EBPF_OBJECT.is_empty() {
            return Err(GuardError::NotBuiltIn);
        }
        let tracefs = tracefs::ensure_mounted()?;
        check_layout(tracefs)?;
        let mut ebpf = super::loader_for(&[MARKERS]).load(EBPF_OBJECT)?;
        for (name, event) in PROGRAMS {
            let program: &mut TracePoint = ebpf
                .program_mut(name)
                .ok_or(GuardError::Missing(name))?
                .try_into()
                .map_err(|e| GuardError::Attach(e, event))?;
            program.load().map_err(|e| GuardError::Attach(e, event))?;
            program
                .attach(CATEGORY, event)
                .map_err(|e| GuardError::Attach(e, event))?;
        }
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
