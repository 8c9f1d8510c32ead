//! Kernel interfaces: every file, system call and ioctl rksm uses, each wrapped once, so that
//! the layers above speak in processes, pages and ranges rather than in file formats.

pub mod caps;
pub mod ksmd;
pub mod limits;
pub mod oom;
pub mod process;
pub mod procfs;
pub mod ranges;
pub mod reader;
pub mod remote;
pub mod rseq;
pub mod softdirty;
pub mod userfaultfd;
