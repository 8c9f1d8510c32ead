//! Privileges: what rksm needs, checked once at start-up.
//!
//! rksm reads other processes' memory and page-frame numbers, stops their threads for remote
//! system calls, and loads an eBPF program. Failing halfway through a pass because of a
//! missing privilege would be the worst time to find out, so each command checks its
//! effective capabilities first and names exactly what is missing.

use std::{fmt, fs};

/// A Linux capability rksm may need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// Read and stop other processes (process_vm_readv, /proc/PID/mem, ptrace).
    SysPtrace,
    /// Page-frame numbers in pagemap, /proc/kpageflags, mounting tracefs.
    SysAdmin,
    /// Performance monitoring: attaching to tracepoints.
    Perfmon,
    /// Loading eBPF programs and creating maps.
    Bpf,
    /// Opening other users' /proc/PID/pagemap and /proc/PID/mem, which are mode 0400 and
    /// 0600 and owned by the process's user: without it even root is refused by the file
    /// mode, before ptrace access is asked.
    DacReadSearch,
    /// Writing other users' /proc/PID/clear_refs (mode 0200, owned by the process's user)
    /// to clear their soft-dirty bits: needed only on kernels that keep them.
    DacOverride,
}

impl Capability {
    fn bit(self) -> u32 {
        match self {
            Capability::SysPtrace => 19,
            Capability::SysAdmin => 21,
            Capability::Perfmon => 38,
            Capability::Bpf => 39,
            Capability::DacReadSearch => 2,
            Capability::DacOverride => 1,
        }
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Capability::SysPtrace => "CAP_SYS_PTRACE",
            Capability::SysAdmin => "CAP_SYS_ADMIN",
            Capability::Perfmon => "CAP_PERFMON",
            Capability::Bpf => "CAP_BPF",
            Capability::DacReadSearch => "CAP_DAC_READ_SEARCH",
            Capability::DacOverride => "CAP_DAC_OVERRIDE",
        })
    }
}

/// What is missing to run a command.
#[derive(Debug, thiserror::Error)]
#[error("missing {}: run rksm as root or give it these capabilities", .0.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", "))]
pub struct MissingCapabilities(pub Vec<Capability>);

/// Effective capabilities from /proc/self/status (`CapEff`, hexadecimal).
fn effective(status: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0)
}

/// Checks that the process has every capability in `needed`.
pub fn require(needed: &[Capability]) -> Result<(), MissingCapabilities> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    missing(effective(&status), needed)
}

fn missing(effective: u64, needed: &[Capability]) -> Result<(), MissingCapabilities> {
    let missing: Vec<Capability> = needed
        .iter()
        .copied()
        .filter(|c| effective & (1 << c.bit()) == 0)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(MissingCapabilities(missing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_exactly_what_is_missing() {
        let all = [
            Capability::SysPtrace,
            Capability::SysAdmin,
            Capability::Perfmon,
            Capability::Bpf,
            Capability::DacReadSearch,
        ];
        assert!(
            missing(effective("CapEff:\t000001fffeffffff\n"), &all).is_ok(),
            "root in this container"
        );
        let err = missing(1 << 19 | 1 << 21 | 1 << 2, &all).unwrap_err();
        assert_eq!(
            missing(1 << 2, &[Capability::DacOverride]).unwrap_err().0,
            [Capability::DacOverride]
        );
        assert_eq!(err.0, [Capability::Perfmon, Capability::Bpf]);
        assert_eq!(
            err.to_string(),
            "missing CAP_PERFMON, CAP_BPF: run rksm as root or give it these capabilities"
        );
        assert!(missing(0, &[]).is_ok());
        assert_eq!(effective("garbage"), 0);
    }
}
