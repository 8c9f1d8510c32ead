//! The write-fault tracer: the eBPF program that approximates a dirty bit.
//!
//! [`tracefs`] checks the tracepoint's layout before anything is loaded, [`tracer`] loads and
//! attaches the program and owns its maps, and [`recorder`] drains the ring into a log that the
//! daemon and `rksm trace` both read. The same object's other programs serve the borrow:
//! [`guard`] steps rksm's userfaultfd aside for a target that takes up its own, and
//! [`waits`] tells when a thread entered the wait a borrow interrupted.

pub mod guard;
pub mod recorder;
pub mod tracefs;
pub mod tracer;
pub mod waits;
