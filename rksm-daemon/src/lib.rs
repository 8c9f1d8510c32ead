//! rksm: a userspace KSM that rehashes only the pages an eBPF tracer saw written.
//!
//! The library holds one module per mechanism so each can be tested on its own; the `rksm`
//! binary is a thin command line over it.
//!
//! - Seeing writes: [`tracefs`] (the tracepoint's layout), [`tracer`] (the eBPF program, its
//!   maps and ring), [`arming`] (userfaultfd write-protect + PAGEMAP_SCAN), [`dirty`] (the
//!   hash-only, pagemap and ebpf dirty sources), [`trace`] (the `rksm trace` session).
//! - Reading and comparing: [`targets`] (selection, pidfds, refusals), [`procfs`] (maps,
//!   pagemap, kpageflags, stat, ksm_stat), [`reader`], [`checksum`], [`index`] (stable and
//!   unstable trees), [`scan`] (one pass).
//! - Merging: [`remote`] (ptrace remote system calls), [`merge`] (runs, marking), [`ksmd`]
//!   (settings owned and restored), [`daemon`] (passes, accounting, backoff, domains).
//! - Operating: [`config`] (the TOML file), [`status`] (socket, metrics), [`caps`].
//! - Measuring: [`workload`] and [`bench`](mod@bench) (rksm against ksmd).

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
