//! Merge domains: which targets may share merged pages, and which domain owns a content.
//!
//! ksmd merges any two mergeable pages with equal bytes, so rksm keeps domains apart by what
//! it marks: a content (by checksum) is marked in one domain only, the first to mark it, and
//! never in another. Domains and content ownership are counted by the targets that hold them
//! and go when the last of those targets goes, so nothing here outlives the processes it is
//! about. A checksum collision only makes ownership stricter.

use std::collections::{hash_map::Entry, HashMap, HashSet};

use crate::engine::keys::{KeyMap, KeySet};
use crate::kernel::process;

/// Which processes may share merged pages with each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DomainPolicy {
    /// Processes of the same user (all of real, effective, saved and filesystem uids).
    #[default]
    Uid,
    /// Processes of the same cgroup.
    Cgroup,
    /// All targets.
    None,
}

crate::value_enum_text!(DomainPolicy => "merge domain");

/// The `uid` domain of a process with user ids `uids` (real, effective, saved, filesystem).
fn uid_domain(uids: &[u32]) -> Option<String> {
    let first = *uids.first()?;
    Some(if uids.iter().all(|&u| u == first) {
        format!("uid {first}")
    } else {
        let all: Vec<String> = uids.iter().map(u32::to_string).collect();
        format!("uid {}", all.join(","))
    })
}

impl DomainPolicy {
    /// The name of the domain of `pid`, whose user ids are known to be `uids` (read with its
    /// other state, so that `uid` domains cost no read of their own).
    pub fn domain_with_uids(self, pid: u32, uids: &[u32]) -> Option<String> {
        match self {
            DomainPolicy::Uid => uid_domain(uids),
            _ => self.domain_of(pid),
        }
    }

    /// The name of the domain `pid` belongs to (None if /proc no longer says).
    pub fn domain_of(self, pid: u32) -> Option<String> {
        match self {
            DomainPolicy::None => Some("all".into()),
            DomainPolicy::Uid => {
                // All of its user ids, read again every pass: a process that changes one
                // (setuid, seteuid) changes domain.
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                uid_domain(&process::status_ids(&status, "Uid:")?)
            }
            DomainPolicy::Cgroup => {
                // The whole membership list: v2's single line, or every v1 hierarchy's.
                let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
                Some(format!("cgroup {}", cgroups.trim().replace('\n', ";")))
            }
        }
    }
}

/// What to do about processes rksm does not target that mark their own memory mergeable
/// while their merge domain is not every target's: ksmd would merge their pages with the
/// targets', so they can probe every page rksm marks in another domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OutsiderPolicy {
    /// Refuse to start, naming them.
    #[default]
    Refuse,
    /// Start, and warn naming them (once each).
    Warn,
}

crate::value_enum_text!(OutsiderPolicy => "policy");

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
            crate::kernel::procfs::printable(&self.comm),
            crate::kernel::procfs::printable(&self.domain)
        )
    }
}

/// Every process but `targets` (pids) and rksm whose memory is mergeable (its ksm_stat says
/// so) and whose domain under `policy` differs from one of `target_domains`. With one domain
/// for all (`none`) there are none.
pub fn mergeable_outsiders(
    policy: DomainPolicy,
    targets: &HashSet<u32>,
    target_domains: &HashSet<String>,
) -> Vec<Outsider> {
    if policy == DomainPolicy::None || target_domains.is_empty() {
        return Vec::new();
    }
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<Outsider> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me && !targets.contains(pid))
        .filter(|&pid| crate::kernel::procfs::KsmStat::read(pid).is_some_and(|k| k.mergeable))
        .filter_map(|pid| {
            let domain = policy.domain_of(pid)?;
            if target_domains.iter().all(|d| *d == domain) {
                return None;
            }
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            Some(Outsider {
                pid,
                comm: comm.trim_end().to_string(),
                domain,
            })
        })
        .collect();
    found.sort_by_key(|o| o.pid);
    found
}

/// The domains in use, numbered, and which domain owns each marked content.
#[derive(Debug, Default)]
pub struct Domains {
    /// Domain name → (number, targets in it).
    ids: HashMap<String, (u32, usize)>,
    next: u32,
    /// Content checksum → (owning domain, targets that claimed it).
    owners: KeyMap<(u32, usize)>,
    /// Contents found merged across domains: no domain marks them again. A prober that
    /// guessed one learns it once; the targets holding it stop sharing it.
    contested: KeySet,
}

impl Domains {
    /// A target joins domain `name`; returns its number.
    pub fn join(&mut self, name: &str) -> u32 {
        let next = &mut self.next;
        let entry = self.ids.entry(name.to_string()).or_insert_with(|| {
            *next += 1;
            (*next - 1, 0)
        });
        entry.1 += 1;
        entry.0
    }

    /// A target of domain `name` leaves, releasing the contents it claimed; returns true if
    /// the domain is now empty (and forgotten).
    pub fn leave(&mut self, name: &str, claimed: &KeySet) -> bool {
        for sum in claimed {
            if let Entry::Occupied(mut owner) = self.owners.entry(*sum) {
                owner.get_mut().1 -= 1;
                if owner.get().1 == 0 {
                    owner.remove();
                }
            }
        }
        let Some((_, members)) = self.ids.get_mut(name) else {
            return false;
        };
        *members -= 1;
        if *members > 0 {
            return false;
        }
        self.ids.remove(name);
        true
    }

    /// Domains with targets in them.
    pub fn count(&self) -> usize {
        self.ids.len()
    }

    /// Contents owned by some domain.
    pub fn owned_contents(&self) -> usize {
        self.owners.len()
    }

    /// The number of domain `name`, if a target is in it.
    pub fn id_of(&self, name: &str) -> Option<u32> {
        self.ids.get(name).map(|&(id, _)| id)
    }

    /// The domain that owns content `sum`, if one does.
    pub fn owner(&self, sum: u64) -> Option<u32> {
        self.owners.get(&sum).map(|&(owner, _)| owner)
    }

    /// Content `sum` was found merged across domains: no domain may mark it from now on.
    pub fn contest(&mut self, sum: u64) {
        self.contested.insert(sum);
    }

    /// Contents found merged across domains.
    pub fn contested(&self) -> usize {
        self.contested.len()
    }

    /// Whether a target of domain `id`, which has claimed `claimed`, may mark content `sum`:
    /// yes if no domain owns it yet (it then owns it) or if `id` does, and it was never
    /// found merged across domains.
    pub fn claim(&mut self, sum: u64, id: u32, claimed: &mut KeySet) -> bool {
        if self.contested.contains(&sum) {
            return false;
        }
        if claimed.contains(&sum) {
            return self.owners.get(&sum).is_some_and(|&(owner, _)| owner == id);
        }
        let owner = self.owners.entry(sum).or_insert((id, 0));
        if owner.0 != id {
            return false;
        }
        owner.1 += 1;
        claimed.insert(sum);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_belongs_to_the_first_domain_until_its_last_claimant_leaves() {
        let mut domains = Domains::default();
        let (a, b) = (domains.join("uid 0"), domains.join("uid 1000"));
        let a2 = domains.join("uid 0");
        assert_eq!(a, a2);
        assert_ne!(a, b);
        let (mut claims_a, mut claims_a2, mut claims_b) =
            (KeySet::default(), KeySet::default(), KeySet::default());
        assert!(domains.claim(7, a, &mut claims_a));
        assert!(domains.claim(7, a, &mut claims_a), "claiming again is fine");
        assert!(domains.claim(7, a2, &mut claims_a2), "same domain");
        assert!(
            !domains.claim(7, b, &mut claims_b),
            "another domain's content"
        );
        assert!(
            !domains.leave("uid 0", &claims_a),
            "the domain keeps a member"
        );
        assert!(
            !domains.claim(7, b, &mut claims_b),
            "still owned through a2"
        );
        assert!(domains.leave("uid 0", &claims_a2), "last member gone");
        assert_eq!(domains.count(), 1);
        assert!(domains.claim(7, b, &mut claims_b), "free again");
        assert_eq!(domains.owned_contents(), 1);
        assert!(domains.leave("uid 1000", &claims_b));
        assert_eq!((domains.count(), domains.owned_contents()), (0, 0));
        assert_ne!(domains.join("uid 0"), a, "numbers are never reused");
    }

    #[test]
    fn a_uid_domain_names_one_id_or_all_four() {
        assert_eq!(uid_domain(&[1000; 4]).as_deref(), Some("uid 1000"));
        assert_eq!(
            uid_domain(&[1000, 0, 1000, 0]).as_deref(),
            Some("uid 1000,0,1000,0")
        );
        assert_eq!(
            DomainPolicy::Uid.domain_with_uids(1, &[7; 4]).as_deref(),
            Some("uid 7")
        );
    }

    #[test]
    fn a_contested_content_is_no_domains_to_mark() {
        let mut domains = Domains::default();
        let a = domains.join("uid 0");
        let mut claims = KeySet::default();
        assert!(domains.claim(7, a, &mut claims));
        assert_eq!(domains.owner(7), Some(a));
        assert_eq!(domains.id_of("uid 0"), Some(a));
        domains.contest(7);
        assert!(!domains.claim(7, a, &mut claims), "not even its owner's");
        assert!(domains.claim(8, a, &mut claims), "other contents are");
        assert_eq!(domains.contested(), 1);
    }
}
