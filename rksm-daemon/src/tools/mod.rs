//! Tools that measure rksm: `rksm trace` (the tracer alone), the synthetic workload, and
//! `rksm bench` (rksm against ksmd). The daemon's passes never call into this layer.

pub mod bench;
pub mod trace;
pub mod workload;
