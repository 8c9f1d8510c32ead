//! Mergeable outsiders: processes rksm does not target whose memory is mergeable, in a merge
//! domain some target is not in. ksmd merges their pages with the targets', so they could
//! probe, through ksmd, every page rksm marks in another domain.
//!
//! Only /proc says which processes are mergeable (each one's `ksm_stat`), and a host holds
//! thousands of processes: reading every one's file at every pass cost a steady pass more
//! than its pages did. So the look remembers each process it read by its /proc entry's inode
//! number, which procfs allocates anew for every process (a pid reused since shows another),
//! and reads only what may have changed: processes new since the last look, those the mark
//! watch saw ask for mergeable memory (`madvise`, `prctl`: the only calls that make memory
//! mergeable; a child inherits it from a parent, but a child is a new process), and those
//! mergeable at the last look. Every process is read again once a minute, and at every look
//! when there is no mark watch or when it may have dropped records (its map was full).

use std::{
    collections::{HashMap, HashSet},
    os::unix::fs::DirEntryExt,
    time::{Duration, Instant},
};

use rksm_common::marks::MAX_MARKERS;

use super::domains::DomainPolicy;
use crate::kernel::procfs;

/// How often every process's ksm_stat is read again, whatever the mark watch says.
const EVERY_PROCESS: Duration = Duration::from_secs(60);

/// The domain given to a process whose /proc files could not be read: it counts as an
/// outsider of a domain of its own.
const UNREADABLE: &str = "unreadable";

/// A process outside the targets with mergeable memory, in a domain some target is not in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outsider {
    /// Its pid.
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// Its merge domain.
    pub domain: String,
}

impl std::fmt::Display for Outsider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} ({}, {})",
            self.pid,
            procfs::printable(&self.comm),
            procfs::printable(&self.domain)
        )
    }
}

/// What a look at /proc found of one process.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Its /proc entry's inode number.
    inode: u64,
    /// Whether its memory was mergeable (or its ksm_stat unreadable while it lived).
    mergeable: bool,
}

/// The looks for mergeable outsiders, and what each remembers for the next.
#[derive(Debug, Default)]
pub struct OutsiderLooks {
    seen: HashMap<u32, Seen>,
    every_process_at: Option<Instant>,
    /// The processes whose ksm_stat the last look read.
    #[cfg(test)]
    last_read: HashSet<u32>,
}

impl OutsiderLooks {
    /// Every process but `targets` (pids) and rksm whose memory is mergeable (its ksm_stat
    /// says so), or that asked to make memory mergeable since the last look (`marked`, from
    /// the mark watch; None without one), and whose domain under `policy` differs from one
    /// of `target_domains`. With one domain for all (`none`) there are none. A live process
    /// whose files cannot be read is listed (rksm cannot tell what it marks); one with no
    /// memory (a kernel thread, a zombie) is not.
    pub fn look(
        &mut self,
        policy: DomainPolicy,
        targets: &HashSet<u32>,
        target_domains: &HashSet<String>,
        marked: Option<&HashSet<u32>>,
    ) -> Vec<Outsider> {
        if policy == DomainPolicy::None || target_domains.is_empty() {
            self.seen.clear();
            return Vec::new();
        }
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let every_process = marked.is_none_or(|m| m.len() >= MAX_MARKERS as usize)
            || self
                .every_process_at
                .is_none_or(|at| at.elapsed() >= EVERY_PROCESS);
        if every_process {
            self.every_process_at = Some(Instant::now());
        }
        let me = std::process::id();
        let alive = |pid: u32| std::path::Path::new(&format!("/proc/{pid}")).exists();
        let mut seen = HashMap::with_capacity(self.seen.len());
        let mut mergeable = Vec::new();
        #[cfg(test)]
        self.last_read.clear();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            // A target that stops being one is new to the look.
            if pid == me || targets.contains(&pid) {
                continue;
            }
            let inode = entry.ino();
            let before = self.seen.get(&pid).filter(|s| s.inode == inode);
            let read = every_process
                || marked.is_some_and(|m| m.contains(&pid))
                || before.is_none_or(|s| s.mergeable);
            let now = match (read, before) {
                (true, _) | (_, None) => {
                    #[cfg(test)]
                    self.last_read.insert(pid);
                    match procfs::read_text(format!("/proc/{pid}/ksm_stat")) {
                        Ok(text) => procfs::KsmStat::parse(&text).is_none_or(|k| k.mergeable),
                        // Exited, or a kernel before 6.1, which has no ksm_stat: there only
                        // the mark watch sees who marks.
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                        Err(_) => alive(pid),
                    }
                }
                (false, Some(s)) => s.mergeable,
            };
            let mergeable_now = now || marked.is_some_and(|m| m.contains(&pid));
            seen.insert(
                pid,
                Seen {
                    inode,
                    mergeable: mergeable_now,
                },
            );
            if mergeable_now {
                mergeable.push(pid);
            }
        }
        self.seen = seen;
        let mut found: Vec<Outsider> = mergeable
            .into_iter()
            .filter_map(|pid| {
                let domain = match policy.domain_of(pid) {
                    Some(domain) => domain,
                    None if alive(pid) => UNREADABLE.to_string(),
                    None => return None,
                };
                if target_domains.iter().all(|d| *d == domain) {
                    return None;
                }
                let comm = procfs::read_text(format!("/proc/{pid}/comm")).unwrap_or_default();
                Some(Outsider {
                    pid,
                    comm: comm.trim_end().to_string(),
                    domain,
                })
            })
            .filter(|o| alive(o.pid))
            .collect();
        found.sort_by_key(|o| o.pid);
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::process::Sleeper;

    /// A `sleep` started under `PR_SET_MEMORY_MERGE`: mergeable from birth without a call of
    /// its own that the mark watch could see, as a child of such a process is.
    struct Marker {
        child: std::process::Child,
    }

    /// Whether this kernel says in /proc which processes are mergeable (6.1+), and this
    /// process may read it.
    fn ksm_stat_readable() -> bool {
        procfs::read_text("/proc/self/ksm_stat").is_ok()
    }

    fn domains_but_mine() -> HashSet<String> {
        // A domain no process of this test is in: every mergeable process is an outsider.
        HashSet::from(["uid 4294967294".to_string()])
    }

    #[test]
    fn a_process_is_read_once_until_it_marks_or_a_minute_passes() {
        if !ksm_stat_readable() {
            return;
        }
        // A process of this test's own, not mergeable, alive through every look: other
        // tests start and end processes meanwhile, so only what is read of it is counted.
        // A `sleep`, whose memory is not mergeable.
        let quiet = Sleeper::spawn();
        let pid = quiet.pid();
        let mut looks = OutsiderLooks::default();
        let none = HashSet::new();
        let domains = domains_but_mine();
        looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        assert!(looks.last_read.contains(&pid), "the first look reads it");
        looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        assert!(
            !looks.last_read.contains(&pid),
            "a second look reads it again though it is not new, not marked, not mergeable"
        );
        // A process the mark watch names is read again, and listed while mergeable.
        let marked = HashSet::from([pid, std::process::id()]);
        let found = looks.look(DomainPolicy::Uid, &none, &domains, Some(&marked));
        assert!(looks.last_read.contains(&pid), "a marked process is read");
        assert!(found.iter().any(|o| o.pid == pid), "not found: {found:?}");
        // rksm itself is never an outsider, whatever the watch says.
        assert!(found.iter().all(|o| o.pid != std::process::id()));
        // Counted mergeable at that look, it is read at the next, and found not to be.
        looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        assert!(
            looks.last_read.contains(&pid),
            "a process mergeable before is read"
        );
        looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        assert!(
            !looks.last_read.contains(&pid),
            "read once it was not mergeable"
        );
        // Without a mark watch, every process is read at every look.
        looks.look(DomainPolicy::Uid, &none, &domains, None);
        assert!(looks.last_read.contains(&pid), "read without a mark watch");
        // A pid the look has not seen under this inode is new, so it is read.
        looks.seen.entry(pid).and_modify(|s| s.inode ^= 1);
        looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        assert!(looks.last_read.contains(&pid), "a reused pid is read");
    }

    #[test]
    fn a_process_mergeable_from_birth_is_found_at_the_next_look_and_after() {
        if !ksm_stat_readable() {
            return;
        }
        let mut looks = OutsiderLooks::default();
        let none = HashSet::new();
        let domains = domains_but_mine();
        looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        // A process started after the look, mergeable from birth, as a child of a process
        // that set PR_SET_MEMORY_MERGE is: new to the look, so it is read.
        let marker = Marker::spawn();
        let found = looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        assert!(
            found.iter().any(|o| o.pid == marker.child.id()),
            "not found: {found:?}"
        );
        // Still listed at the next look, without the mark watch naming it.
        let found = looks.look(DomainPolicy::Uid, &none, &domains, Some(&none));
        assert!(found.iter().any(|o| o.pid == marker.child.id()));
    }

    impl Marker {
        fn spawn() -> Marker {
            use std::os::unix::process::CommandExt;
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("30");
            // SAFETY: prctl between fork and exec touches nothing but the child's own flags.
            unsafe {
                cmd.pre_exec(|| {
                    const PR_SET_MEMORY_MERGE: libc::c_int = 67;
                    if libc::prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = cmd.spawn().expect("sleep");
            // The flag holds from exec on; wait until its ksm_stat says so, with a deadline.
            let deadline = Instant::now() + Duration::from_secs(5);
            let path = format!("/proc/{}/ksm_stat", child.id());
            while Instant::now() < deadline {
                let text = procfs::read_text(&path).unwrap_or_default();
                if procfs::KsmStat::parse(&text).is_some_and(|k| k.mergeable) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Marker { child }
        }
    }

    impl Drop for Marker {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
