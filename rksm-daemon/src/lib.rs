//! rksm: a userspace KSM that rehashes only the pages an eBPF tracer saw written.
//!
//! The library holds one module per mechanism so each can be tested on its own; the `rksm`
//! binary is a thin command line over it. What exists so far:
//!
//! - [`tracefs`]: finds tracefs and checks the tracepoint layout the eBPF program relies on.
//! - [`tracer`]: loads the eBPF write-fault tracer, tracks processes, drains its records.
//! - [`targets`]: turns pids into processes pinned by pidfds, or into refusal reasons.
//! - [`trace`]: the `rksm trace` session: per-process written pages and write faults.
//!
//! Scanning, checksums, the dedup index, arming and merging get their own modules as they land.

pub mod arming;
pub mod bench;
pub mod caps;
pub mod checksum;
pub mod config;
pub mod daemon;
pub mod dirty;
pub mod index;
pub mod ksmd;
pub mod merge;
pub mod procfs;
pub mod reader;
pub mod remote;
pub mod scan;
pub mod status;
pub mod targets;
pub mod trace;
pub mod tracefs;
pub mod tracer;
pub mod workload;
