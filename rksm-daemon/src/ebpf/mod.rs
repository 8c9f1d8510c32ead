//! The write-fault tracer: the eBPF program that approximates a dirty bit.
//!
//! [`tracefs`] checks the tracepoint's layout before anything is loaded, [`tracer`] loads and
//! attaches the program and owns its maps, and [`recorder`] drains the ring into a log that the
//! daemon and `rksm trace` both read. The same object's other programs serve the borrow:
//! [`guard`] steps rksm's userfaultfd aside for a target that takes up its own, and
//! [`waits`] tells when a thread entered the wait a borrow interrupted. [`marks`] serves the
//! merge domains: it records every process that asks to make memory mergeable.

pub mod guard;
pub mod marks;
pub mod recorder;
pub mod tracefs;
pub mod tracer;
pub mod waits;

/// Every sized map of the object, with the smallest size the kernel takes for it: each part
/// loads the object for its own programs, and the maps it does not use stay that small.
const SMALLEST: [(&str, u32); 6] = [
    (rksm_common::names::RECORDS, 4096),
    (rksm_common::names::TRACKED, 1),
    (rksm_common::uffd_guard::HELD, 1),
    (rksm_common::waits::WAITERS, 1),
    (rksm_common::waits::ENTERED, 1),
    (rksm_common::marks::MARKERS, 1),
];

/// A loader of the object for a part whose maps are `own`: every other map is made as small
/// as the kernel allows.
fn loader_for(own: &[&str]) -> aya::EbpfLoader<'static> {
    let mut loader = aya::EbpfLoader::new();
    for (name, size) in SMALLEST {
        if !own.contains(&name) {
            loader.map_max_entries(name, size);
        }
    }
    loader
}
