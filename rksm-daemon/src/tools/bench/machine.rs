//! What a bench ran on, recorded in its report.
//!
//! Every figure the bench prints belongs to a machine: its CPU decides which checksum code a
//! pass runs (xxh64 of sixteen pages side by side needs AVX-512, crc32c in hardware needs
//! SSE4.2), and its memory what a first pass is held to. The machine a project's figures come
//! from can change under it (a host replaced, a virtual machine moved), so each report says
//! which one it came from, read off the machine as the bench starts, rather than leaving the
//! docs to remember.

use serde::Serialize;

use crate::engine::checksum::wide;

/// The machine, as far as it bears on the bench's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    /// `model name` in /proc/cpuinfo, as the hypervisor tells it on a virtual machine.
    pub cpu_model: String,
    /// CPUs this process may run on.
    pub cpus: usize,
    /// `MemTotal`, in GiB.
    pub memory_gib: f64,
    /// The kernel's release (/proc/sys/kernel/osrelease).
    pub kernel: String,
    /// Whether the CPU says it runs under a hypervisor (the `hypervisor` flag).
    pub virtual_machine: bool,
    /// Whether xxh64 hashes a batch's pages side by side here (AVX-512 F, DQ and VL).
    pub xxh64_side_by_side: bool,
    /// Whether crc32c runs on the CPU's own instruction here (SSE4.2). Checked on x86_64
    /// only; false elsewhere.
    pub crc32c_in_hardware: bool,
}

impl Machine {
    /// This machine. What cannot be read is left empty or zero, never guessed.
    pub fn this() -> Machine {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        Machine::from_texts(
            &read("/proc/cpuinfo"),
            &read("/proc/meminfo"),
            &read("/proc/sys/kernel/osrelease"),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            wide::available(),
            crc32c_in_hardware(),
        )
    }

    /// A machine from the texts of /proc/cpuinfo, /proc/meminfo and the kernel's release,
    /// with what the process found of its CPUs and instructions.
    fn from_texts(
        cpuinfo: &str,
        meminfo: &str,
        osrelease: &str,
        cpus: usize,
        xxh64_side_by_side: bool,
        crc32c_in_hardware: bool,
    ) -> Machine {
        // The first CPU's fields stand for all: a machine of mixed CPUs is not one this
        // project runs on.
        let field = |name: &str| {
            cpuinfo.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                (key.trim() == name).then(|| value.trim().to_string())
            })
        };
        let memory_kib = meminfo.lines().find_map(|line| {
            let rest = line.strip_prefix("MemTotal:")?;
            rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
        });
        Machine {
            cpu_model: field("model name").unwrap_or_default(),
            cpus,
            memory_gib: memory_kib.map_or(0.0, |kib| kib as f64 / (1u64 << 20) as f64),
            kernel: osrelease.trim().to_string(),
            virtual_machine: field("flags")
                .is_some_and(|flags| flags.split_whitespace().any(|f| f == "hypervisor")),
            xxh64_side_by_side,
            crc32c_in_hardware,
        }
    }

    /// One line for the report: `AMD EPYC, 2 CPUs, 23.4 GiB, Linux 6.18.0, ...`.
    pub fn line(&self) -> String {
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        format!(
            "{}, {} CPUs, {:.1} GiB, Linux {}{}; xxh64 of pages side by side (AVX-512 F, DQ, VL): {}; crc32c in hardware (SSE4.2): {}",
            if self.cpu_model.is_empty() {
                "CPU not named"
            } else {
                &self.cpu_model
            },
            self.cpus,
            self.memory_gib,
            self.kernel,
            if self.virtual_machine {
                ", a virtual machine"
            } else {
                ""
            },
            yes_no(self.xxh64_side_by_side),
            yes_no(self.crc32c_in_hardware),
        )
    }
}

/// Whether the crc32c crate takes the CPU's instruction here: on x86_64, SSE4.2.
fn crc32c_in_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("sse4.2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPUINFO: &str = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx2 hypervisor avx512f\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n";
    const MEMINFO: &str = "MemTotal:       24568516 kB\nMemFree:        23000000 kB\n";

    #[test]
    fn a_virtual_machine_is_read_off_its_proc_files() {
        let m = Machine::from_texts(CPUINFO, MEMINFO, "6.18.0-rksm\n", 2, true, true);
        assert_eq!(m.cpu_model, "AMD EPYC");
        assert_eq!(m.cpus, 2);
        assert!((m.memory_gib - 23.43).abs() < 0.01, "{}", m.memory_gib);
        assert_eq!(m.kernel, "6.18.0-rksm");
        assert!(m.virtual_machine);
        assert_eq!(
            m.line(),
            "AMD EPYC, 2 CPUs, 23.4 GiB, Linux 6.18.0-rksm, a virtual machine; xxh64 of pages \
             side by side (AVX-512 F, DQ, VL): yes; crc32c in hardware (SSE4.2): yes"
        );
    }

    #[test]
    fn what_cannot_be_read_is_left_empty_not_guessed() {
        let m = Machine::from_texts("", "", "", 0, false, false);
        assert_eq!(m.cpu_model, "");
        assert_eq!(m.memory_gib, 0.0);
        assert!(!m.virtual_machine);
        assert!(m
            .line()
            .starts_with("CPU not named, 0 CPUs, 0.0 GiB, Linux ;"));
        // A flags line without the hypervisor's flag is a machine of its own.
        let bare = Machine::from_texts("flags : fpu avx2\n", MEMINFO, "6.1.0", 4, false, true);
        assert!(!bare.virtual_machine);
        assert!(bare.line().contains("side by side (AVX-512 F, DQ, VL): no"));
    }
}
