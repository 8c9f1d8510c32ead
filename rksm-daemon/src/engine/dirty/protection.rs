//! Which write-protect source each target gets, and why.
//!
//! A dirty bit needs every first write after a pass to fault, and the kernel offers two ways
//! to arrange that from outside a process: asynchronous userfaultfd write protection (Linux
//! 6.7+, a userfaultfd made inside the target, protection page by page) and soft-dirty
//! (`CONFIG_MEM_SOFT_DIRTY`, any version, a clear of the whole address space through
//! /proc/PID/clear_refs). Some kernels have one, some both (Debian 12's 6.12), some neither.
//! What the kernel offers is probed once ([`Offer::probe`]); which source a target gets is
//! decided per target ([`Offer::plan`]), because targets differ in what they use themselves:
//! one that clears its own soft-dirty bits must not have them cleared again, and one that
//! holds a userfaultfd of its own is never given rksm's, whose registrations would make its
//! own fail (one that takes one up later is handed over to, see `ebpf::guard`). Where both are
//! offered and nothing about the target decides, soft-dirty is preferred
//! ([`PREFERRED_WHERE_BOTH`]): it borrows no thread and puts no fd in the target, and it
//! cannot make the target's own `UFFDIO_REGISTER` fail with `EBUSY`; userfaultfd re-protects
//! only the written pages, which docs/BENCHMARKS.md ("Kernels") measures against it.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::kernel::{procfs, softdirty, userfaultfd};

/// What makes the first write to a page after a pass fault, for one target.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum WriteProtect {
    /// Asynchronous userfaultfd write protection, written bits from PAGEMAP_SCAN (6.7+).
    Userfaultfd,
    /// /proc/PID/clear_refs, written bits from pagemap's soft-dirty bit (55).
    SoftDirty,
    /// Nothing: every page is hashed every pass.
    #[default]
    None,
}

impl WriteProtect {
    /// The name status, logs and metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            WriteProtect::Userfaultfd => "userfaultfd",
            WriteProtect::SoftDirty => "soft-dirty",
            WriteProtect::None => "none",
        }
    }
}

impl fmt::Display for WriteProtect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which source the operator allows (`--write-protect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WriteProtectChoice {
    /// Per target, the best the kernel offers: soft-dirty where both are offered, unless the
    /// target uses soft-dirty bits itself.
    #[default]
    Auto,
    /// Userfaultfd only (Linux 6.7+).
    Userfaultfd,
    /// Soft-dirty only (`CONFIG_MEM_SOFT_DIRTY`).
    SoftDirty,
}

crate::value_enum_text!(WriteProtectChoice => "write-protect source");

/// The source `auto` prefers where the kernel offers both (see the module documentation).
pub const PREFERRED_WHERE_BOTH: WriteProtect = WriteProtect::SoftDirty;

/// The write-protect sources this kernel offers, and which the operator allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// Asynchronous userfaultfd write protection works (Linux 6.7+).
    pub userfaultfd: bool,
    /// The kernel keeps soft-dirty bits.
    pub soft_dirty: bool,
    /// What the operator allows.
    pub choice: WriteProtectChoice,
}

/// What [`Offer::check`] refuses: a source asked for that this kernel does not have.
#[derive(Debug, thiserror::Error)]
#[error("--write-protect {choice}: {why}")]
pub struct NotOffered {
    choice: WriteProtectChoice,
    why: &'static str,
}

/// Why the kernel offers no userfaultfd write protection.
const NO_USERFAULTFD: &str =
    "this kernel has no asynchronous userfaultfd write protection (WP_ASYNC, Linux 6.7+)";
/// Why a target holding a userfaultfd of its own is not armed with one.
const OWN_USERFAULTFD: &str =
    "it holds a userfaultfd of its own, whose registrations rksm's would make fail (EBUSY)";
/// Why the kernel offers no soft-dirty bits.
const NO_SOFT_DIRTY: &str =
    "this kernel keeps no soft-dirty bits (built without CONFIG_MEM_SOFT_DIRTY)";

impl Offer {
    /// What this kernel offers, probed on rksm's own memory.
    pub fn probe(choice: WriteProtectChoice) -> Offer {
        Offer {
            userfaultfd: userfaultfd::supported(),
            soft_dirty: softdirty::supported(),
            choice,
        }
    }

    /// Whether any source the operator allows is offered.
    pub fn any(&self) -> bool {
        self.userfaultfd_allowed() || self.soft_dirty_allowed()
    }

    /// Whether targets may be write-protected with userfaultfd.
    pub fn userfaultfd_allowed(&self) -> bool {
        self.userfaultfd && self.choice != WriteProtectChoice::SoftDirty
    }

    fn soft_dirty_allowed(&self) -> bool {
        self.soft_dirty && self.choice != WriteProtectChoice::Userfaultfd
    }

    /// Refuses a source asked for by name that this kernel does not have.
    pub fn check(&self) -> Result<(), NotOffered> {
        let why = match self.choice {
            WriteProtectChoice::Userfaultfd if !self.userfaultfd => NO_USERFAULTFD,
            WriteProtectChoice::SoftDirty if !self.soft_dirty => NO_SOFT_DIRTY,
            _ => return Ok(()),
        };
        Err(NotOffered {
            choice: self.choice,
            why,
        })
    }

    /// Why no source is offered at all (when [`Offer::any`] is false).
    pub fn why_none(&self) -> String {
        format!("{NO_USERFAULTFD}, and {NO_SOFT_DIRTY}")
    }

    /// The sources to try for process `pid`, best first, and why each source left out is
    /// left out. `soft_dirty_refused` is a reason found earlier not to clear its bits.
    pub fn plan(&self, pid: u32, soft_dirty_refused: Option<&str>) -> Plan {
        self.plan_with(&TargetUse::of(pid), soft_dirty_refused)
    }

    fn plan_with(&self, uses: &TargetUse, soft_dirty_refused: Option<&str>) -> Plan {
        let mut plan = Plan::default();
        let soft_dirty = if !self.soft_dirty {
            Err(NO_SOFT_DIRTY.to_string())
        } else if self.choice == WriteProtectChoice::Userfaultfd {
            Err("--write-protect userfaultfd".into())
        } else if let Some(why) = soft_dirty_refused {
            Err(why.to_string())
        } else if let Some(holder) = &uses.clear_refs {
            Err(format!(
                "it clears its own soft-dirty bits ({holder}), and a clear by rksm would lose writes it has not read yet"
            ))
        } else if uses.kvm {
            Err("it runs a KVM guest, and a clear drops the guest's second-level page tables (an MMU-notifier invalidation of all its memory)".into())
        } else {
            Ok(())
        };
        let uffd = if !self.userfaultfd {
            Err(NO_USERFAULTFD.to_string())
        } else if self.choice == WriteProtectChoice::SoftDirty {
            Err("--write-protect soft-dirty".into())
        } else if uses.userfaultfd {
            Err(OWN_USERFAULTFD.into())
        } else {
            Ok(())
        };
        let soft_dirty_first = PREFERRED_WHERE_BOTH == WriteProtect::SoftDirty;
        let candidates = match soft_dirty_first {
            true => [
                (WriteProtect::SoftDirty, soft_dirty),
                (WriteProtect::Userfaultfd, uffd),
            ],
            false => [
                (WriteProtect::Userfaultfd, uffd),
                (WriteProtect::SoftDirty, soft_dirty),
            ],
        };
        plan.first_because = format!(
            "preferred where the kernel offers both: {}",
            match PREFERRED_WHERE_BOTH {
                WriteProtect::SoftDirty =>
                    "no borrowed thread, no fd in the target, no collision with its own userfaultfd",
                _ => "it protects again only the pages written",
            }
        );
        for (source, allowed) in candidates {
            match allowed {
                Ok(()) => plan.order.push(source),
                Err(why) => plan.left_out.push((source, why)),
            }
        }
        plan
    }
}

/// What a target uses itself that bears on the choice.
#[derive(Debug, Default, Clone)]
struct TargetUse {
    /// An open clear_refs, named.
    clear_refs: Option<String>,
    /// A KVM vCPU.
    kvm: bool,
    /// A userfaultfd of its own.
    userfaultfd: bool,
}

impl TargetUse {
    /// One look at the target's open files.
    fn of(pid: u32) -> TargetUse {
        let files = procfs::open_files(pid);
        TargetUse {
            clear_refs: softdirty::clear_refs_among(&files),
            kvm: files.iter().any(|(_, f)| procfs::is_kvm(f)),
            userfaultfd: files.iter().any(|(_, f)| procfs::is_userfaultfd(f)),
        }
    }
}

/// The sources to try for one target, and why the others are left out.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Best first.
    pub order: Vec<WriteProtect>,
    /// Sources not tried, with why.
    pub left_out: Vec<(WriteProtect, String)>,
    /// Why the first comes first, when both could be used.
    pub first_because: String,
}

impl Plan {
    /// Why `chosen` is used: why the other source is not (left out, or `failed`), or else
    /// why it comes first.
    pub fn why_chosen(&self, chosen: WriteProtect, failed: &[(WriteProtect, String)]) -> String {
        let others: Vec<String> = self
            .left_out
            .iter()
            .chain(failed)
            .filter(|(source, _)| *source != chosen)
            .map(|(source, why)| format!("not {source}: {why}"))
            .collect();
        match others.is_empty() {
            true => self.first_because.clone(),
            false => others.join("; "),
        }
    }

    /// Why the target ends up with no source, from what was left out and what failed.
    pub fn why_none(&self, failed: &[(WriteProtect, String)]) -> String {
        // What failed says more than why a source was left out: one reason per source.
        let left_out = self
            .left_out
            .iter()
            .filter(|(source, _)| failed.iter().all(|(s, _)| s != source));
        let reasons: Vec<String> = left_out
            .chain(failed)
            .map(|(source, why)| format!("{source}: {why}"))
            .collect();
        reasons.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(userfaultfd: bool, soft_dirty: bool, choice: WriteProtectChoice) -> Offer {
        Offer {
            userfaultfd,
            soft_dirty,
            choice,
        }
    }

    #[test]
    fn each_kernel_gets_what_it_offers_and_says_why_not_the_rest() {
        let plain = TargetUse::default();
        let auto = WriteProtectChoice::Auto;
        // Debian 12's 6.1: soft-dirty only.
        let plan = offer(false, true, auto).plan_with(&plain, None);
        assert_eq!(plan.order, [WriteProtect::SoftDirty]);
        assert!(plan.left_out[0].1.contains("Linux 6.7"), "{plan:?}");
        // This host's 6.18: userfaultfd only.
        let plan = offer(true, false, auto).plan_with(&plain, None);
        assert_eq!(plan.order, [WriteProtect::Userfaultfd]);
        assert!(plan.left_out[0].1.contains("CONFIG_MEM_SOFT_DIRTY"));
        // Both: the preferred one first, the other as the fallback.
        let plan = offer(true, true, auto).plan_with(&plain, None);
        assert_eq!(plan.order[0], PREFERRED_WHERE_BOTH);
        assert_eq!(plan.order.len(), 2);
        assert!(plan
            .why_chosen(plan.order[0], &[])
            .starts_with("preferred where the kernel offers both"));
        // The fallback, once the first failed, says why.
        let failed = [(plan.order[0], "EACCES".to_string())];
        assert_eq!(
            plan.why_chosen(plan.order[1], &failed),
            format!("not {}: EACCES", plan.order[0])
        );
        // Neither.
        let none = offer(false, false, auto);
        assert!(!none.any());
        let plan = none.plan_with(&plain, None);
        assert!(plan.order.is_empty());
        assert_eq!(plan.why_none(&[]).matches("; ").count(), 1, "{plan:?}");
    }

    #[test]
    fn what_a_target_uses_itself_decides_before_the_default() {
        let both = offer(true, true, WriteProtectChoice::Auto);
        let gc = TargetUse {
            clear_refs: Some("fd 5 -> /proc/7/clear_refs".into()),
            ..TargetUse::default()
        };
        let plan = both.plan_with(&gc, None);
        assert_eq!(plan.order, [WriteProtect::Userfaultfd]);
        assert!(plan.left_out[0].1.contains("fd 5 -> /proc/7/clear_refs"));
        // On a soft-dirty-only kernel that leaves nothing, and says why.
        let plan = offer(false, true, WriteProtectChoice::Auto).plan_with(&gc, None);
        assert!(plan.order.is_empty());
        assert!(plan
            .why_none(&[])
            .contains("clears its own soft-dirty bits"));
        let vm = TargetUse {
            kvm: true,
            ..TargetUse::default()
        };
        assert_eq!(both.plan_with(&vm, None).order, [WriteProtect::Userfaultfd]);
        let postcopy = TargetUse {
            userfaultfd: true,
            ..TargetUse::default()
        };
        assert_eq!(
            both.plan_with(&postcopy, None).order,
            [WriteProtect::SoftDirty]
        );
        // Where userfaultfd is all there is, it is left out all the same: hashed.
        let plan = offer(true, false, WriteProtectChoice::Auto).plan_with(&postcopy, None);
        assert!(plan.order.is_empty());
        assert!(plan.why_none(&[]).contains("a userfaultfd of its own"));
        // A reason found earlier (someone else clears its bits) holds too.
        let plan = both.plan_with(&TargetUse::default(), Some("cleared by another"));
        assert_eq!(plan.order, [WriteProtect::Userfaultfd]);
    }

    #[test]
    fn a_source_asked_for_by_name_is_the_only_one_and_must_exist() {
        let plain = TargetUse::default();
        let only_sd = offer(true, true, WriteProtectChoice::SoftDirty);
        assert_eq!(
            only_sd.plan_with(&plain, None).order,
            [WriteProtect::SoftDirty]
        );
        let only_uffd = offer(true, true, WriteProtectChoice::Userfaultfd);
        assert_eq!(
            only_uffd.plan_with(&plain, None).order,
            [WriteProtect::Userfaultfd]
        );
        let err = offer(true, false, WriteProtectChoice::SoftDirty)
            .check()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("--write-protect soft-dirty: {NO_SOFT_DIRTY}")
        );
        assert!(offer(false, true, WriteProtectChoice::Userfaultfd)
            .check()
            .is_err());
        assert!(offer(false, false, WriteProtectChoice::Auto)
            .check()
            .is_ok());
        assert_eq!(
            "soft-dirty".parse::<WriteProtectChoice>(),
            Ok(WriteProtectChoice::SoftDirty)
        );
    }
}
