//! Tools that measure rksm: `rksm trace` (the tracer alone), the synthetic workload, qemu
//! guests as workloads, and `rksm bench` (rksm against ksmd). The daemon's passes never call into this layer.

pub mod bench;
pub mod guest;
pub mod trace;
pub mod workload;
