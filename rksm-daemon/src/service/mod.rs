//! What operators touch: the configuration file, and the status socket with its metrics.

pub mod config;
pub mod status;
