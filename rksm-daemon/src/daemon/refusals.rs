//! Processes rksm will not touch, and why: refused by identity (pid and start time), so
//! that a later process that reuses a pid inherits nothing, and counted once per process and
//! reason.

use std::{
    collections::{HashMap, HashSet},
    fmt,
};

use super::Daemon;
use crate::kernel::{process::ProcessId, remote::RemoteRefusal};

/// Processes refused, by identity (pid and start time), so a later process that reuses a
/// pid inherits nothing.
#[derive(Debug, Default)]
pub(super) struct Refusals {
    /// Refused for as long as they live: never touched again.
    lasting: HashMap<ProcessId, String>,
    /// Refusals already counted, so each process counts once per reason.
    counted: HashSet<(ProcessId, String)>,
}

impl Refusals {
    pub(super) fn lasting(&self, id: ProcessId) -> bool {
        self.lasting.contains_key(&id)
    }

    /// Forgets processes that have exited (whatever now has their pid is someone else).
    pub(super) fn prune(&mut self) {
        let alive = |id: &ProcessId| ProcessId::of(id.pid) == Some(*id);
        self.lasting.retain(|id, _| alive(id));
        self.counted.retain(|(id, _)| alive(id));
    }
}

impl Daemon {
    /// Counts a refusal once per process and reason.
    pub(super) fn count_refusal(&mut self, id: ProcessId, reason: &str, why: &dyn fmt::Display) {
        if self.refusals.counted.insert((id, reason.to_string())) {
            log::warn!("refusing pid {}: {why}", id.pid);
            *self.stats.targets_refused.entry(reason.into()).or_default() += 1;
        }
    }

    /// Refuses process `id` for as long as it lives: it is never touched again.
    pub(super) fn refuse(&mut self, id: ProcessId, reason: &str, why: &dyn fmt::Display) {
        self.count_refusal(id, reason, why);
        self.refusals.lasting.insert(id, reason.into());
        if self.targets.get(&id.pid).is_some_and(|t| t.id() == id) {
            self.drop_target(id.pid);
        }
    }

    /// Refuses target `pid` for `reason`: for good if the reason lasts, else for this pass.
    pub(super) fn refuse_remote(&mut self, pid: u32, reason: RemoteRefusal) {
        let Some(id) = self.targets.get(&pid).map(|t| t.id()) else {
            return;
        };
        if reason.is_lasting() {
            self.refuse(id, reason.as_str(), &reason);
        } else {
            self.count_refusal(id, reason.as_str(), &reason);
            if let Some(target) = self.targets.get_mut(&pid) {
                target.skip_this_pass();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_not_inherited_by_a_process_that_reuses_the_pid() {
        let me = ProcessId::of(std::process::id()).unwrap();
        // An earlier process that had this pid, and was refused for good.
        let earlier = ProcessId {
            start_ticks: me.start_ticks - 1,
            ..me
        };
        let mut refusals = Refusals::default();
        refusals.lasting.insert(earlier, "seccomp".into());
        refusals.counted.insert((earlier, "seccomp".into()));
        assert!(refusals.lasting(earlier));
        assert!(!refusals.lasting(me), "inherited by the pid's new owner");
        refusals.lasting.insert(me, "seccomp".into());
        refusals.prune();
        assert!(refusals.lasting(me), "a live process's refusal lasts");
        assert!(
            !refusals.lasting(earlier),
            "the exited process is forgotten"
        );
        assert!(refusals.counted.is_empty());
    }
}
