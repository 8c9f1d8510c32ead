//! The benchmark's workload: a process with known duplicate, zero, unique, volatile and
//! fork-shared memory that can check its own memory on request.
//!
//! `rksm bench` starts N of these (`rksm workload`, one process each) so that ksmd and every
//! rksm mode work on the same memory, and asks each to verify itself at the end: a merge that
//! changed a byte shows up as a failed integrity check, not as a better number.

use std::{
    io::{self, BufRead, Write},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use rksm_common::PAGE;
const WORDS: usize = PAGE / 8;

/// Why a profile cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// Neither a profile's name nor a file that can be read.
    #[error("`{name}` is neither a profile name (quick, static, mixed, static-4g, quarter-4g, quarter-16g, alike-4g, large, guests) nor a readable file: {source}")]
    Unknown {
        /// What was given.
        name: String,
        /// Why it could not be read as a file.
        source: std::io::Error,
    },
    /// A file that is not a profile's JSON.
    #[error("{file}: {source}")]
    Malformed {
        /// The file.
        file: String,
        /// What is wrong in it.
        source: serde_json::Error,
    },
    /// Fields out of their bounds.
    #[error("{0}: processes must be at least 1 and same_value_percent at most 100")]
    OutOfBounds(String),
    /// A guest profile with fields guests do not have, or too little RAM.
    #[error("{0}: a guest profile has only duplicate_mib and unique_mib, and leaves the guest kernel 64 MiB of guest_ram_mib")]
    Guests(String),
}

/// What each workload process holds, in MiB, and how fast it writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Number of processes.
    pub processes: u32,
    /// Pages identical across all processes.
    pub duplicate_mib: u64,
    /// Zero-filled pages.
    pub zero_mib: u64,
    /// Pages different in every process.
    pub unique_mib: u64,
    /// Pages rewritten while the benchmark runs.
    pub volatile_mib: u64,
    /// Volatile pages rewritten per second (per process).
    pub volatile_pages_per_sec: u64,
    /// Of the rewrites, how many in 100 write the value the page already had.
    pub same_value_percent: u64,
    /// Pages shared copy-on-write with a forked child.
    pub fork_mib: u64,
    /// Volatile pages start identical in every process (otherwise each process's differ),
    /// so rksm merges some of them and the writers' same-value rewrites then break merged
    /// pages copy-on-write. Off in the built-in profiles; the torture test turns it on.
    #[serde(default)]
    pub volatile_identical: bool,
    /// Non-zero: each process is a qemu guest with this much RAM ([`crate::tools::guest`]),
    /// which marks all of it mergeable itself and fills `duplicate_mib` and `unique_mib` of
    /// it; the other sizes must then be zero.
    #[serde(default)]
    pub guest_ram_mib: u64,
    /// Every page holds the same bytes where rksm samples a new page (the cache line at the
    /// middle of the page): built so that the sample tells no page from another.
    #[serde(default)]
    pub alike: bool,
}

impl Profile {
    /// The built-in profiles.
    pub fn named(name: &str) -> Option<Profile> {
        let base = Profile {
            processes: 4,
            duplicate_mib: 64,
            zero_mib: 16,
            unique_mib: 32,
            volatile_mib: 8,
            volatile_pages_per_sec: 2000,
            same_value_percent: 50,
            fork_mib: 16,
            volatile_identical: false,
            guest_ram_mib: 0,
            alike: false,
        };
        match name {
            // Small enough that every configuration runs in seconds.
            "quick" => Some(Profile {
                duplicate_mib: 24,
                zero_mib: 8,
                unique_mib: 8,
                volatile_mib: 4,
                volatile_pages_per_sec: 500,
                fork_mib: 4,
                ..base
            }),
            // Mostly static memory: what the dirty-bit modes are for.
            "static" => Some(Profile {
                volatile_mib: 1,
                volatile_pages_per_sec: 50,
                ..base
            }),
            "mixed" => Some(base),
            // The steady-state workload: 4 GiB, half of it duplicates, 1% rewritten.
            "static-4g" => Some(Profile {
                duplicate_mib: 512,
                zero_mib: 0,
                unique_mib: 502,
                volatile_mib: 10,
                volatile_pages_per_sec: 50,
                fork_mib: 0,
                ..base
            }),
            // 4 GiB, a quarter of it duplicates: where most new memory is one of a kind.
            "quarter-4g" => Some(Profile {
                duplicate_mib: 256,
                zero_mib: 0,
                unique_mib: 758,
                volatile_mib: 10,
                volatile_pages_per_sec: 50,
                fork_mib: 0,
                ..base
            }),
            // quarter-4g four times over: what rksm keeps per page at 16 GiB.
            "quarter-16g" => Some(Profile {
                duplicate_mib: 1024,
                zero_mib: 0,
                unique_mib: 3032,
                volatile_mib: 40,
                volatile_pages_per_sec: 50,
                fork_mib: 0,
                ..base
            }),
            // static-4g with every page alike where rksm samples: the sample's worst case.
            "alike-4g" => Some(Profile {
                duplicate_mib: 512,
                zero_mib: 0,
                unique_mib: 502,
                volatile_mib: 10,
                volatile_pages_per_sec: 50,
                fork_mib: 0,
                alike: true,
                ..base
            }),
            // Several GiB in all.
            "large" => Some(Profile {
                processes: 8,
                duplicate_mib: 512,
                zero_mib: 64,
                unique_mib: 256,
                volatile_mib: 64,
                volatile_pages_per_sec: 20_000,
                fork_mib: 64,
                ..base
            }),
            // Three qemu guests (TCG) that mark their own RAM mergeable: the guests profile.
            "guests" => Some(Profile {
                processes: 3,
                duplicate_mib: 128,
                zero_mib: 0,
                unique_mib: 128,
                volatile_mib: 0,
                volatile_pages_per_sec: 0,
                same_value_percent: 0,
                fork_mib: 0,
                guest_ram_mib: 384,
                ..base
            }),
            _ => None,
        }
    }

    /// True if the processes are qemu guests.
    pub fn is_guests(&self) -> bool {
        self.guest_ram_mib > 0
    }

    /// Pages ksmd sweeps when everything is marked mergeable.
    pub fn mergeable_pages(&self) -> u64 {
        let per_process = if self.is_guests() {
            self.guest_ram_mib
        } else {
            self.duplicate_mib + self.zero_mib + self.unique_mib + self.volatile_mib + self.fork_mib
        };
        u64::from(self.processes) * 256 * per_process
    }

    /// The named profile, or a JSON file with every field.
    pub fn load(name_or_file: &str) -> Result<Profile, ProfileError> {
        if let Some(profile) = Profile::named(name_or_file) {
            return Ok(profile);
        }
        let name = || name_or_file.to_string();
        let text =
            std::fs::read_to_string(name_or_file).map_err(|source| ProfileError::Unknown {
                name: name(),
                source,
            })?;
        let profile: Profile =
            serde_json::from_str(&text).map_err(|source| ProfileError::Malformed {
                file: name(),
                source,
            })?;
        if profile.processes == 0 || profile.same_value_percent > 100 {
            return Err(ProfileError::OutOfBounds(name()));
        }
        if profile.is_guests()
            && (profile.zero_mib + profile.volatile_mib + profile.fork_mib > 0
                || profile.duplicate_mib + profile.unique_mib + 64 > profile.guest_ram_mib)
        {
            return Err(ProfileError::Guests(name()));
        }
        Ok(profile)
    }

    fn pages(mib: u64) -> usize {
        (mib * 256) as usize
    }

    /// Pages of its processes that are duplicated or zero-filled (what `Marks::Duplicates`
    /// marks).
    pub fn duplicate_pages(&self) -> u64 {
        u64::from(self.processes) * 256 * (self.duplicate_mib + self.zero_mib)
    }

    /// Pages merging can free at best: every copy of a duplicate page but one, every zero page
    /// but those ksmd keeps (one per `max_page_sharing` sharers).
    pub fn achievable_sharing(&self, max_page_sharing: u64) -> u64 {
        let n = u64::from(self.processes);
        let shared = |copies: u64| copies - copies.div_ceil(max_page_sharing.max(2));
        Self::pages(self.duplicate_mib) as u64 * shared(n)
            + shared(n * Self::pages(self.zero_mib) as u64)
    }
}

fn word(seed: u64, i: usize) -> u64 {
    (seed.wrapping_add(1))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left((i % 64) as u32)
        ^ i as u64
}

/// The process's memory: one anonymous mapping, laid out duplicate | zero | unique | volatile.
struct Memory {
    base: *mut u64,
    pages: usize,
    /// The profile's `alike`.
    alike: bool,
}

// SAFETY: the mapping lives as long as the process; the writer thread and the command loop
// access it under the `Expected` mutex.
unsafe impl Send for Memory {}

impl Memory {
    fn map(pages: usize, alike: bool) -> io::Result<Memory> {
        if pages == 0 {
            return Ok(Memory {
                base: std::ptr::null_mut(),
                pages,
                alike,
            });
        }
        // SAFETY: a fresh private anonymous mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Memory {
            base: ptr.cast(),
            pages,
            alike,
        })
    }

    fn fill(&self, page: usize, seed: Option<u64>) {
        assert!(page < self.pages);
        for w in 0..WORDS {
            let value = self.value(seed, w);
            // SAFETY: page < pages and w < WORDS: inside the mapping.
            unsafe { self.base.add(page * WORDS + w).write_volatile(value) };
        }
    }

    fn holds(&self, page: usize, seed: Option<u64>) -> bool {
        (0..WORDS).all(|w| {
            // SAFETY: as in fill.
            let v = unsafe { self.base.add(page * WORDS + w).read_volatile() };
            v == self.value(seed, w)
        })
    }

    /// Word `w` of a page of `seed`: in an `alike` profile, the words rksm samples are the
    /// same in every page that is not zeros.
    fn value(&self, seed: Option<u64>, w: usize) -> u64 {
        use rksm_common::sample::{OFFSETS, SAMPLE_BYTES};
        let sampled = || {
            OFFSETS
                .iter()
                .any(|&at| (at as usize / 8..(at as usize + SAMPLE_BYTES) / 8).contains(&w))
        };
        match seed {
            None => 0,
            Some(_) if self.alike && sampled() => 0x5a5a_5a5a_5a5a_5a5a,
            Some(s) => word(s, w),
        }
    }
}

/// What each page must hold: `None` is zeros.
struct Expected {
    memory: Memory,
    seeds: Vec<Option<u64>>,
}

/// What a workload process marks MADV_MERGEABLE itself, for the runs of ksmd alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marks {
    /// Nothing: rksm decides what is marked.
    Nothing,
    /// All its memory, as a program that asks for KSM does.
    Everything,
    /// Only its duplicated and zero-filled pages, as if something had found them for free.
    Duplicates,
}

/// Runs one workload process: fills memory, prints `ready`, then answers `verify` (`ok` or
/// `mismatch PAGE`) and `exit` on stdin until stdin closes. It marks its own memory
/// MADV_MERGEABLE as `marks` says (the ksmd configurations).
pub fn serve(profile: &Profile, index: u32, marks: Marks) -> io::Result<()> {
    let (dup, zero, unique, volatile, fork) = (
        Profile::pages(profile.duplicate_mib),
        Profile::pages(profile.zero_mib),
        Profile::pages(profile.unique_mib),
        Profile::pages(profile.volatile_mib),
        Profile::pages(profile.fork_mib),
    );
    let total = dup + zero + unique + volatile + fork;
    let memory = Memory::map(total, profile.alike)?;
    let mut seeds = Vec::with_capacity(total);
    let me = u64::from(index + 1) << 32;
    seeds.extend((0..dup).map(|p| Some(p as u64)));
    seeds.extend((0..zero).map(|_| None));
    seeds.extend((0..unique).map(|p| Some(me + p as u64)));
    let volatile_base = if profile.volatile_identical {
        1 << 40
    } else {
        me + (1 << 24)
    };
    seeds.extend((0..volatile).map(|p| Some(volatile_base + p as u64)));
    seeds.extend((0..fork).map(|p| Some(me + (2 << 24) + p as u64)));
    for (page, seed) in seeds.iter().enumerate() {
        memory.fill(page, *seed);
    }
    if fork > 0 {
        // Only the fork region is shared with the child: the rest is not inherited.
        let private = (total - fork) * PAGE;
        if private > 0 {
            // SAFETY: madvise on our own mapping.
            if unsafe { libc::madvise(memory.base.cast(), private, libc::MADV_DONTFORK) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // SAFETY: the child only sleeps until its parent dies; no locks are held here.
        match unsafe { libc::fork() } {
            -1 => return Err(io::Error::last_os_error()),
            // SAFETY: prctl and pause take no pointers.
            0 => unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                loop {
                    libc::pause();
                }
            },
            _ => {}
        }
        if private > 0 {
            // SAFETY: madvise on our own mapping.
            let rc = unsafe { libc::madvise(memory.base.cast(), private, libc::MADV_DOFORK) };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    // The layout puts the duplicated pages first, then the zero-filled ones.
    let marked = match marks {
        Marks::Nothing => 0,
        Marks::Everything => total,
        Marks::Duplicates => dup + zero,
    };
    if marked > 0 {
        // SAFETY: madvise on our own mapping, `marked` pages from its start.
        if unsafe { libc::madvise(memory.base.cast(), marked * PAGE, libc::MADV_MERGEABLE) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    let expected = Arc::new(Mutex::new(Expected { memory, seeds }));
    if volatile > 0 && profile.volatile_pages_per_sec > 0 {
        let expected = expected.clone();
        let (first, rate, same) = (
            dup + zero + unique,
            profile.volatile_pages_per_sec,
            profile.same_value_percent,
        );
        std::thread::spawn(move || {
            let started = Instant::now();
            let mut written: u64 = 0;
            loop {
                // Keep to the rate: write what is due, then sleep a little.
                let due = (started.elapsed().as_secs_f64() * rate as f64) as u64;
                while written < due {
                    // Pages in a scrambled order, so writes hit merged and unmerged pages alike.
                    let page = first
                        + (written.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) as usize % volatile;
                    let mut e = expected.lock().unwrap_or_else(|p| p.into_inner());
                    let seed = if written % 100 < same {
                        e.seeds[page]
                    } else {
                        Some(me + (3 << 24) + written)
                    };
                    e.memory.fill(page, seed);
                    e.seeds[page] = seed;
                    written += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
    }
    let mut out = io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    for line in io::stdin().lock().lines() {
        let reply = match line?.trim() {
            "verify" => {
                let e = expected.lock().unwrap_or_else(|p| p.into_inner());
                match (0..e.seeds.len()).find(|&p| !e.memory.holds(p, e.seeds[p])) {
                    None => "ok".to_string(),
                    Some(page) => format!("mismatch {page}"),
                }
            }
            "exit" => break,
            other => format!("error unknown command `{other}`"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

/// A running `rksm workload` process, driven over its stdin; killed when dropped.
pub struct WorkloadProcess {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: io::BufReader<std::process::ChildStdout>,
}

impl WorkloadProcess {
    /// Starts `rksm workload` (the binary at `rksm`) and waits until its memory is filled.
    pub fn start(
        rksm: &std::path::Path,
        profile: &str,
        index: u32,
        marks: Marks,
    ) -> io::Result<WorkloadProcess> {
        let mut cmd = std::process::Command::new(rksm);
        cmd.args([
            "workload",
            "--profile",
            profile,
            "--index",
            &index.to_string(),
        ]);
        match marks {
            Marks::Nothing => {}
            Marks::Everything => {
                cmd.arg("--mergeable");
            }
            Marks::Duplicates => {
                cmd.arg("--mark-duplicates");
            }
        }
        let mut child = cmd
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = io::BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        if line.trim() != "ready" {
            return Err(io::Error::other(format!(
                "workload {index} did not start: `{}`",
                line.trim()
            )));
        }
        Ok(WorkloadProcess {
            child,
            stdin,
            stdout,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Asks the process to check all its memory: `ok`, or `mismatch PAGE`, or why it could
    /// not answer.
    pub fn verify(&mut self) -> String {
        let mut line = String::new();
        match writeln!(self.stdin, "verify").and_then(|()| self.stdout.read_line(&mut line)) {
            Ok(_) => line.trim().to_string(),
            Err(e) => format!("no answer: {e}"),
        }
    }
}

impl Drop for WorkloadProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_profiles_exist_and_files_are_checked() {
        for name in [
            "quick",
            "static",
            "mixed",
            "static-4g",
            "quarter-4g",
            "quarter-16g",
            "alike-4g",
            "large",
            "guests",
        ] {
            assert!(Profile::named(name).is_some(), "{name}");
        }
        assert!(Profile::load("no-such-profile")
            .unwrap_err()
            .to_string()
            .contains("neither a profile name"));
        let path = std::env::temp_dir().join(format!("rksm-profile-{}.json", std::process::id()));
        std::fs::write(&path, r#"{"processes": 2, "duplicate_mib": 1}"#).unwrap();
        assert!(Profile::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string()
            .contains("missing field"));
        let mut full = serde_json::to_value(Profile::named("quick").unwrap()).unwrap();
        std::fs::write(&path, full.to_string()).unwrap();
        assert_eq!(
            Profile::load(path.to_str().unwrap()).unwrap(),
            Profile::named("quick").unwrap()
        );
        full["colour"] = "blue".into();
        std::fs::write(&path, full.to_string()).unwrap();
        assert!(Profile::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string()
            .contains("colour"));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn an_alike_profile_gives_every_page_the_digest_of_every_other() {
        use rksm_common::sample::digest_of;
        let memory = Memory::map(3, true).unwrap();
        for (page, seed) in [(0, 1), (1, 2), (2, 1 << 40)] {
            memory.fill(page, Some(seed));
        }
        // SAFETY: the three pages just mapped and filled.
        let bytes = unsafe { std::slice::from_raw_parts(memory.base.cast::<u8>(), 3 * PAGE) };
        let pages: Vec<&[u8]> = bytes.chunks_exact(PAGE).collect();
        let d = digest_of;
        assert_eq!(d(pages[0]), d(pages[1]));
        assert_eq!(d(pages[0]), d(pages[2]));
        assert_ne!(pages[0], pages[1], "alike, not equal");
        assert!(memory.holds(1, Some(2)) && !memory.holds(1, Some(1)));
        let plain = Memory::map(2, false).unwrap();
        plain.fill(0, Some(1));
        plain.fill(1, Some(2));
        // SAFETY: as above.
        let bytes = unsafe { std::slice::from_raw_parts(plain.base.cast::<u8>(), 2 * PAGE) };
        assert_ne!(d(&bytes[..PAGE]), d(&bytes[PAGE..]));
    }

    #[test]
    fn achievable_sharing_counts_copies_minus_kept_pages() {
        let p = Profile {
            processes: 4,
            duplicate_mib: 1,
            zero_mib: 1,
            unique_mib: 5,
            volatile_mib: 5,
            volatile_pages_per_sec: 1,
            same_value_percent: 0,
            fork_mib: 5,
            volatile_identical: false,
            guest_ram_mib: 0,
            alike: false,
        };
        // 256 duplicate pages x 3 extra copies; 1024 zero pages sharing ceil(1024/256) = 4 KSM pages.
        assert_eq!(p.achievable_sharing(256), 256 * 3 + 1020);
    }
}
