//! Target selection: which processes the operator's selectors name, and which are refused.
//!
//! Explicit pids are always taken. The sets (cgroups, user ids, everything, a process tree)
//! add up, and a command-name pattern narrows them: a name is the process's own to choose,
//! so any user could join a selection made by name alone (which is still allowed, for a
//! one-user host). The minimum age then filters. Each match is opened as a [`Process`]
//! (pinned by a pidfd) or listed with the reason rksm will not touch it.

use std::{
    collections::BTreeSet,
    fs, io,
    path::{Path, PathBuf},
    time::Duration,
};

use regex::Regex;

use crate::kernel::{
    limits,
    process::{status_ids, Process, RefusalReason, TargetError},
    procfs::{read_text, stat_field},
};

/// Where cgroups are mounted; relative `--cgroup` paths are taken from here.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Which processes to work on, as the operator selected them: explicit pids, and the sets
/// (cgroups, user ids, everything, a process tree), which add up and which `comm` narrows
/// (or, alone, selects by name); the minimum age then filters.
#[derive(Debug, Clone, Default)]
pub struct TargetSpec {
    /// Explicit pids: each must exist and be acceptable, or the selection fails.
    pub pids: Vec<u32>,
    /// Cgroup directories (v1 or v2), absolute or relative to /sys/fs/cgroup; the processes
    /// of the cgroup and of every cgroup below it.
    pub cgroups: Vec<PathBuf>,
    /// Processes all of whose user ids (real, effective, saved, filesystem) are in this list.
    pub uids: Vec<u32>,
    /// Command names (/proc/PID/comm): narrows the sets, or selects by itself.
    pub comm: Option<Regex>,
    /// Every user process.
    pub all: bool,
    /// Only processes at least this old.
    pub min_age: Option<Duration>,
    /// A process and all its descendants (`rksm run`).
    pub tree_of: Option<u32>,
}

/// Errors in a target selection: all are the operator's input, so all are exit status 2.
#[derive(Debug, thiserror::Error)]
pub enum SelectionError {
    /// Nothing was selected at all.
    #[error("no targets given: use --pid, --cgroup, --uid, --comm or --all")]
    Empty,
    /// A --pid that cannot be used.
    #[error(transparent)]
    Pid(#[from] TargetError),
    /// A --cgroup directory that does not exist or has no cgroup.procs.
    #[error("cgroup {path} not found: {source}")]
    Cgroup {
        /// The path as resolved.
        path: PathBuf,
        /// Why it could not be read.
        source: io::Error,
    },
}

/// The outcome of a selection: the processes to work on, and those refused with a reason.
#[derive(Debug, Default)]
pub struct Selection {
    /// Processes to work on, by pid.
    pub processes: Vec<Process>,
    /// Processes matched by a selector but refused.
    pub refused: Vec<(u32, String, RefusalReason)>,
    /// Processes not looked at because rksm had no file descriptor left: they are looked at
    /// again next time.
    pub short_of_files: usize,
}

impl TargetSpec {
    /// Whether any selector was given.
    pub fn is_empty(&self) -> bool {
        self.pids.is_empty() && self.comm.is_none() && !self.has_sets()
    }

    /// Whether a set selector (cgroups, user ids, everything, a process tree) was given.
    fn has_sets(&self) -> bool {
        !self.cgroups.is_empty() || !self.uids.is_empty() || self.all || self.tree_of.is_some()
    }

    /// Whether processes are selected by command name alone, which any user can give a
    /// process of theirs.
    pub fn by_name_only(&self) -> bool {
        self.comm.is_some() && !self.has_sets()
    }

    /// Resolves the selection now. Explicit pids must be usable; processes found through a
    /// cgroup, a name or --all that are refused (kernel threads, rksm itself) are listed in
    /// [`Selection::refused`]; processes that exit while being looked at are skipped.
    pub fn resolve(&self) -> Result<Selection, SelectionError> {
        self.resolve_with(true, &|_| false)
    }

    /// Like [`TargetSpec::resolve`], but explicit pids that no longer exist or are refused
    /// are skipped, and so are the pids `known` already holds (nothing is opened for them):
    /// for the daemon's later passes, when processes come and go.
    pub fn resolve_again(&self, known: &dyn Fn(u32) -> bool) -> Result<Selection, SelectionError> {
        self.resolve_with(false, known)
    }

    fn resolve_with(
        &self,
        strict: bool,
        known: &dyn Fn(u32) -> bool,
    ) -> Result<Selection, SelectionError> {
        if self.is_empty() {
            return Err(SelectionError::Empty);
        }
        let mut selection = Selection::default();
        let mut seen = BTreeSet::new();
        for &pid in &self.pids {
            if known(pid) {
                seen.insert(pid);
                continue;
            }
            match Process::open(pid) {
                Ok(process) => {
                    if seen.insert(process.pid()) {
                        selection.processes.push(process);
                    }
                }
                Err(e) if strict => return Err(e.into()),
                Err(TargetError::Io { source, .. }) if limits::out_of_files(&source) => {
                    selection.short_of_files += 1;
                }
                Err(TargetError::Refused { pid, comm, reason }) => {
                    if seen.insert(pid) {
                        selection.refused.push((pid, comm, reason));
                    }
                }
                Err(_) => {}
            }
        }
        let mut in_cgroups = BTreeSet::new();
        for cgroup in &self.cgroups {
            collect_cgroup(&resolve_cgroup(cgroup), &mut in_cgroups)?;
        }
        let in_tree = self.tree_of.map(descendants).unwrap_or_default();
        let mut candidates = in_cgroups.clone();
        candidates.extend(in_tree.iter().copied());
        if self.all || !self.uids.is_empty() || self.by_name_only() {
            candidates.extend(all_pids());
        }
        let sets = self.has_sets();
        let wanted = |pid: u32, comm: &str, uids: &dyn Fn() -> Option<[u32; 4]>| {
            let named = self.comm.as_ref().is_none_or(|re| re.is_match(comm));
            let in_a_set = self.all
                || in_cgroups.contains(&pid)
                || in_tree.contains(&pid)
                || (!self.uids.is_empty()
                    && uids().is_some_and(|ids| ids.iter().all(|u| self.uids.contains(u))));
            named && (!sets || in_a_set)
        };
        for pid in candidates {
            if seen.contains(&pid) || known(pid) {
                continue;
            }
            match Process::open(pid) {
                Ok(process) => {
                    if wanted(pid, process.comm(), &|| Some(process.uids()))
                        && seen.insert(process.pid())
                    {
                        selection.processes.push(process);
                    }
                }
                // Kernel threads are never candidates worth reporting.
                Err(TargetError::Refused { pid, comm, reason })
                    if reason != RefusalReason::KernelThread =>
                {
                    if wanted(pid, &comm, &|| uids_of(pid)) && seen.insert(pid) {
                        selection.refused.push((pid, comm, reason));
                    }
                }
                Err(TargetError::Io { source, .. }) if limits::out_of_files(&source) => {
                    selection.short_of_files += 1;
                }
                Err(_) => {} // exited or unreadable while we looked
            }
        }
        if let Some(min_age) = self.min_age {
            selection.processes.retain(|p| p.age() >= min_age);
        }
        selection.processes.sort_by_key(Process::pid);
        Ok(selection)
    }
}

fn resolve_cgroup(path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        Path::new(CGROUP_ROOT).join(path)
    }
}

/// Adds the pids of `dir` and of every cgroup below it.
fn collect_cgroup(dir: &Path, pids: &mut BTreeSet<u32>) -> Result<(), SelectionError> {
    let procs = dir.join("cgroup.procs");
    let text = fs::read_to_string(&procs).map_err(|source| SelectionError::Cgroup {
        path: dir.to_path_buf(),
        source,
    })?;
    pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                // A child that vanished meanwhile is simply not there any more.
                let _ = collect_cgroup(&entry.path(), pids);
            }
        }
    }
    Ok(())
}

/// `root` and every process below it, from the parent pids in /proc/PID/stat.
fn descendants(root: u32) -> BTreeSet<u32> {
    let parents: Vec<(u32, u32)> = all_pids()
        .into_iter()
        .filter_map(|pid| {
            let stat = read_text(format!("/proc/{pid}/stat")).ok()?;
            Some((pid, stat_field(&stat, 4)?.parse().ok()?))
        })
        .collect();
    let mut tree = BTreeSet::from([root]);
    loop {
        let before = tree.len();
        tree.extend(
            parents
                .iter()
                .filter(|(_, ppid)| tree.contains(ppid))
                .map(|&(pid, _)| pid)
                .collect::<Vec<_>>(),
        );
        if tree.len() == before {
            return tree;
        }
    }
}

/// The real, effective, saved and filesystem user ids of `pid`.
fn uids_of(pid: u32) -> Option<[u32; 4]> {
    status_ids(&read_text(format!("/proc/{pid}/status")).ok()?, "Uid:")
}

/// Every numeric entry of /proc: all processes (thread ids are not listed there).
fn all_pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}
