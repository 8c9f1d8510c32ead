//! Which processes are targets: adopted at start and as the selection finds new ones, each
//! given its domain, refused when it must be, followed through exec and exit, and the
//! processes outside the targets that mark their own memory mergeable named.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    time::Instant,
};

use super::{
    adopted::Adopted, domains::SeveralDomains, outsiders, Daemon, SHORT_OF_FILES_WARN_EVERY,
};
use crate::{
    ebpf::{guard, marks::MarkWatch, waits},
    engine::target::Target,
    kernel::{
        limits,
        process::{Observed, Process, ProcessId},
        procfs,
        ranges::Range,
        remote::{self, RemoteError},
    },
};

impl Daemon {
    /// Adopts the processes not yet targets and not refused: each gets its record. At start
    /// every match is taken (several domains are then refused as a whole); later, with
    /// `--several-domains refuse`, a process of another domain than the targets' is not.
    pub(super) fn adopt(&mut self, processes: Vec<Process>, at_start: bool) {
        let (mut short, before) = (0, self.targets.len());
        // Their pidfds are open already: when a pass's files fit beside them all, none need
        // be dropped, and the room is not tried again for each.
        let roomy = processes
            .first()
            .is_some_and(|p| limits::room_for(p.pidfd(), limits::PASS_RESERVE));
        for process in processes {
            let pid = process.pid();
            if self.targets.contains_key(&pid) || self.refusals.lasting(process.id()) {
                continue;
            }
            // A target holds its pidfd for as long as it lives; the files a pass needs come
            // first.
            if !roomy && !limits::room_for(process.pidfd(), limits::PASS_RESERVE) {
                short += 1;
                continue;
            }
            // The user ids were read when the process was opened, just now.
            let Some(name) = self.config.domain.domain_with_uids(pid, &process.uids()) else {
                continue;
            };
            if !at_start
                && self.config.several_domains == SeveralDomains::Refuse
                && self.domains.count() > 0
                && self.domains.id_of(&name).is_none()
            {
                let why = format!(
                    "it is in merge domain {}, the targets in {} (--several-domains refuse)",
                    procfs::printable(&name),
                    procfs::printable(&self.domains.names().join(", "))
                );
                self.count_refusal(process.id(), "other_domain", &why);
                continue;
            }
            let domain = self.domains.join(&name);
            log::info!(
                pid, comm = process.comm(), domain = name.as_str();
                "target pid {pid} ({}), merge domain {}",
                procfs::printable(process.comm()),
                procfs::printable(&name)
            );
            let mut target = Target::adopt(process, domain, name);
            // Tracked from adoption in every mode: the copy-on-write accounting needs the
            // tracer even where the dirty source does not.
            if let Some(recorder) = &mut self.recorder {
                if let Err(e) = recorder.track(pid, &mut target.dirty_mut().tracer) {
                    log::warn!("tracer cannot track pid {pid}: {e}");
                }
            }
            if let Some(watch) = waits::installed() {
                watch.watch(pid);
            }
            self.targets.insert(pid, Adopted::new(target));
        }
        if short > 0 {
            self.short_of_files(short, "new process(es) not adopted");
        }
        if self.targets.len() > before {
            self.warn_if_named_by_anyone();
        }
    }

    /// Warns, once, when processes selected by command name alone belong to several users:
    /// any user can give a process of theirs that name.
    fn warn_if_named_by_anyone(&mut self) {
        if self.warned_name_only || !self.config.targets.by_name_only() {
            return;
        }
        let users: BTreeSet<u32> = self
            .targets
            .values()
            .flat_map(|t| t.process().uids())
            .collect();
        if users.len() > 1 {
            self.warned_name_only = true;
            let users: Vec<String> = users.iter().map(u32::to_string).collect();
            log::warn!(
                "the targets are selected by command name alone and belong to several users (uid {}): any user can name a process so; select them by --cgroup or --uid, and narrow that with --comm",
                users.join(", ")
            );
        }
    }

    /// Each domain with targets in it, and the first of its targets' pids, for people.
    pub(super) fn domains_with_pids(&self) -> Vec<String> {
        self.domains
            .names()
            .into_iter()
            .map(|name| {
                let pids: Vec<String> = self
                    .targets
                    .values()
                    .filter(|t| t.domain_name() == name)
                    .map(|t| t.pid().to_string())
                    .collect();
                let more = if pids.len() > 8 { ", ..." } else { "" };
                format!(
                    "{} (pid {}{more})",
                    procfs::printable(name),
                    pids[..pids.len().min(8)].join(", ")
                )
            })
            .collect()
    }

    /// Drops `pid`'s record, and with it everything kept about the process.
    pub(super) fn drop_target(&mut self, pid: u32) {
        let Some(mut target) = self.targets.remove(&pid) else {
            return;
        };
        if let Some(watch) = waits::installed() {
            watch.unwatch(pid);
        }
        if let Some(guard) = guard::installed() {
            guard.forget(pid);
        }
        self.scanner.forget(&mut target);
        if let Some(recorder) = &mut self.recorder {
            recorder.forget(pid);
        }
        if self.domains.leave(target.domain_name(), target.owned()) {
            self.scanner.forget_domain(target.domain());
        }
    }

    /// Counts `n` processes or targets left for this pass for want of file descriptors, and
    /// says so: at once, then at most once a minute while it lasts.
    pub(super) fn short_of_files(&mut self, n: usize, what: &str) {
        self.stats.short_of_files += n as u64;
        let now = Instant::now();
        if self
            .warned_short_of_files
            .is_none_or(|at| now.duration_since(at) >= SHORT_OF_FILES_WARN_EVERY)
        {
            self.warned_short_of_files = Some(now);
            log::warn!(
                "out of file descriptors (limit {}): {n} {what}; tried again every pass; raise the hard limit (LimitNOFILE)",
                limits::open_files_limit()
            );
        }
    }

    /// Step 1: exited and exec'd targets are dropped, new matches adopted, and targets that
    /// cannot be borrowed now are refused before anything is done to them.
    pub(super) fn refresh_targets(&mut self) {
        for target in self.targets.values_mut() {
            target.refresh();
        }
        let exited: Vec<u32> = self
            .targets
            .values()
            .filter(|t| t.process().has_exited())
            .map(|t| t.pid())
            .collect();
        for pid in exited {
            log::info!("pid {pid} exited");
            self.drop_target(pid);
        }
        // Each target's /proc files, read once for every question below.
        let observed: HashMap<u32, Observed> = self
            .targets
            .values()
            .filter_map(|t| Some((t.pid(), t.process().observe()?)))
            .collect();
        // A process that exec'd has a new address space: its arming, marks and checksums
        // describe one that no longer exists. It starts over, as a new target.
        let exec_d: Vec<u32> = self
            .targets
            .values()
            .filter(|t| t.process().has_new_image_in(observed.get(&t.pid())))
            .map(|t| t.pid())
            .collect();
        for pid in exec_d {
            log::info!("pid {pid} executed a new program; starting over with it");
            self.drop_target(pid);
        }
        self.follow_the_processes(&observed);
        self.refusals.prune();
        let targets = &self.targets;
        match self
            .config
            .targets
            .resolve_again(&|pid| targets.contains_key(&pid))
        {
            Ok(selection) => {
                if selection.short_of_files > 0 {
                    self.short_of_files(selection.short_of_files, "new process(es) not looked at");
                }
                for (pid, _, reason) in &selection.refused {
                    if let Some(id) = ProcessId::of(*pid) {
                        if !self.refusals.lasting(id) {
                            self.refuse(id, reason.as_str(), reason);
                        }
                    }
                }
                self.adopt(selection.processes, false);
            }
            Err(e) => log::warn!("refreshing targets: {e}"),
        }
        let pids: Vec<u32> = self.targets.keys().copied().collect();
        for pid in pids {
            // A target adopted just now was not observed: its files are read.
            let borrowable = match observed.get(&pid) {
                Some(o) => remote::check_borrowable_as(pid, o.status(), o.stat()),
                None => remote::check_borrowable(pid),
            };
            if let Err(RemoteError::Refused { reason, .. }) = borrowable {
                self.refuse_remote(pid, reason);
            }
        }
    }

    /// Step 1, continued: what a process is can change under rksm. One that made itself off
    /// limits (a set-id change, `PR_SET_DUMPABLE` 0) is refused from now on and never
    /// borrowed again, so what was marked in it stays marked. One whose merge domain changed
    /// (a `setuid`, a move to another cgroup) takes nothing marked into its new domain: rksm
    /// unmarks what it marked there and places it again, as a new target, next pass.
    fn follow_the_processes(&mut self, observed: &HashMap<u32, Observed>) {
        let outsiders = self.new_outsiders();
        self.warn_about(&outsiders);
        let mut off_limits = Vec::new();
        let mut moved = Vec::new();
        for target in self.targets.values() {
            let standing = observed
                .get(&target.pid())
                .and_then(|o| target.process().standing_in(o));
            let Some(standing) = standing else {
                continue;
            };
            if let Some(reason) = standing.off_limits {
                off_limits.push((target.id(), reason));
            } else if let Some(now) = self
                .config
                .domain
                .domain_with_uids(target.pid(), &standing.uids)
            {
                if now != target.domain_name() {
                    moved.push((target.pid(), now));
                }
            }
        }
        for (id, reason) in off_limits {
            if self
                .targets
                .get(&id.pid)
                .is_some_and(|t| !t.marked().is_empty())
            {
                log::warn!(
                    "pid {}: {reason} now; what rksm marked in it stays marked, since it is not touched again",
                    id.pid
                );
            }
            self.refuse(id, reason.as_str(), &reason);
        }
        for (pid, now) in moved {
            let Some(target) = self.targets.get_mut(&pid) else {
                continue;
            };
            log::warn!(
                "pid {pid} moved from merge domain {} to {}: unmarking what rksm marked in it",
                procfs::printable(target.domain_name()),
                procfs::printable(&now)
            );
            let runs = target.marked().within(Range::new(0, u64::MAX));
            if !runs.is_empty() {
                match self.marker.unmark(&self.borrower, target, &runs) {
                    Ok(outcome) => self.marking_syscalls += outcome.remote_syscalls,
                    Err(e) => log::warn!("pid {pid}: unmarking after a domain change: {e}"),
                }
            }
            self.stats.domain_changes += 1;
            self.drop_target(pid);
        }
    }

    /// Processes outside the targets, of another domain than some target's, whose memory is
    /// mergeable, and which have not been warned about yet.
    pub(super) fn new_outsiders(&mut self) -> Vec<outsiders::Outsider> {
        let pids: HashSet<u32> = self.targets.keys().copied().collect();
        let names: HashSet<String> = self
            .targets
            .values()
            .map(|t| t.domain_name().to_string())
            .collect();
        self.outsiders_seen
            .retain(|id| ProcessId::of(id.pid) == Some(*id));
        let marked = self.marks.as_ref().map(MarkWatch::take);
        self.outsiders =
            self.outsider_looks
                .look(self.config.domain, &pids, &names, marked.as_ref());
        self.outsiders
            .iter()
            .filter(|o| ProcessId::of(o.pid).is_some_and(|id| !self.outsiders_seen.contains(&id)))
            .cloned()
            .collect()
    }

    /// Warns once about each of `outsiders`, and counts them.
    pub(super) fn warn_about(&mut self, outsiders: &[outsiders::Outsider]) {
        for o in outsiders {
            if let Some(id) = ProcessId::of(o.pid) {
                self.outsiders_seen.insert(id);
            }
            log::warn!(
                "{o} marks its memory mergeable outside the targets, in another merge domain: ksmd may merge its pages with a target's, so it can probe what rksm marks"
            );
            self.stats.mergeable_outsiders += 1;
        }
    }
}
