//! Merge domains: which targets may share merged pages, and what each domain may mark.
//!
//! ksmd merges any two mergeable pages with equal bytes, whoever marked them, so over one
//! ksmd no daemon can merge a domain's duplicates without telling that domain something
//! about the others: if another domain's copy is already merged, this domain's copies merge
//! with it or stay apart. rksm therefore decides about a domain's duplicates from that
//! domain's pages only, so that what it marks says nothing about other domains, and undoes
//! what ksmd merges across domains after the fact ([`super::crossings`]): the domain that
//! gives way never marks that content again (it is *contested* for that domain). A domain
//! learns about another only through a ksmd merge it can watch, and once per content.
//!
//! Domains and the first domain to mark each content (which keeps a frame that crossed) are
//! counted by the targets that hold them and go when the last of those targets goes, so
//! nothing here outlives the processes it is about.

use std::collections::{hash_map::Entry, HashMap};

use crate::engine::keys::{KeyMap, KeySet};
use crate::kernel::{process, procfs};

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
                let status = procfs::read_text(format!("/proc/{pid}/status")).ok()?;
                uid_domain(&process::status_ids(&status, "Uid:")?)
            }
            DomainPolicy::Cgroup => {
                // The whole membership list: v2's single line, or every v1 hierarchy's.
                let cgroups = procfs::read_text(format!("/proc/{pid}/cgroup")).ok()?;
                Some(format!("cgroup {}", cgroups.trim().replace('\n', ";")))
            }
        }
    }
}

/// Whether the targets may span more than one merge domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SeveralDomains {
    /// Refuse to start if they do, naming the domains; later processes of another domain
    /// than the targets' are not taken up.
    #[default]
    Refuse,
    /// Allow it: each domain can then learn whether another holds a page it guesses, one
    /// ksmd merge cycle per guess (docs/security.md).
    Allow,
}

crate::value_enum_text!(SeveralDomains => "policy");

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

/// The domains in use, numbered, which domain first marked each content, and the contents
/// each domain gave way on.
///
/// Who first marked a content only settles a merge between two domains of targets, which
/// `--several-domains refuse` (the default) rules out: the targets are then of one domain at
/// any time. There the owners are not kept, and a content claimed costs nothing (claims were
/// a fifth of rksm's memory at 16 GiB).
#[derive(Debug, Default)]
pub struct Domains {
    /// Whether targets of several domains may be held at once, so that owners are kept.
    several: bool,
    /// Domain name → (number, targets in it).
    ids: HashMap<String, (u32, usize)>,
    next: u32,
    /// Content checksum → (first domain to mark it, its targets that claimed it).
    owners: KeyMap<(u32, u32)>,
    /// Domain number → contents of that domain found merged with another domain's: that
    /// domain does not mark them again. Other domains' decisions do not look at it, so a
    /// prober learns a content only through a merge of its own, and once.
    contested: HashMap<u32, KeySet>,
}

impl Domains {
    /// No domains yet; `several` says whether targets of several domains may be held at once.
    pub fn new(several: SeveralDomains) -> Self {
        Domains {
            several: several == SeveralDomains::Allow,
            ..Domains::default()
        }
    }

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
        let Some((id, members)) = self.ids.get_mut(name) else {
            return false;
        };
        for sum in claimed {
            if let Entry::Occupied(mut owner) = self.owners.entry(*sum) {
                if owner.get().0 == *id {
                    owner.get_mut().1 -= 1;
                    if owner.get().1 == 0 {
                        owner.remove();
                    }
                }
            }
        }
        *members -= 1;
        if *members > 0 {
            return false;
        }
        let id = *id;
        self.ids.remove(name);
        self.contested.remove(&id);
        true
    }

    /// The names of the domains with targets in them, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.ids.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
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

    /// The first domain still holding a target that marked content `sum`, if one does.
    pub fn owner(&self, sum: u64) -> Option<u32> {
        self.owners.get(&sum).map(|&(owner, _)| owner)
    }

    /// Domain `id` gave way on content `sum` (its copies merged with another domain's): it
    /// does not mark it from now on. Other domains may.
    pub fn contest(&mut self, sum: u64, id: u32) {
        self.contested.entry(id).or_default().insert(sum);
    }

    /// Contents some domain gave way on, counted once per domain.
    pub fn contested(&self) -> usize {
        self.contested.values().map(|sums| sums.len()).sum()
    }

    /// Whether a target of domain `id`, which has claimed `claimed`, may mark content `sum`:
    /// yes unless `id` gave way on it. The answer depends on `id`'s own history only, never
    /// on what other domains hold. The first domain to mark a content is remembered as its
    /// owner, which keeps its frame if ksmd merges it across domains.
    pub fn claim(&mut self, sum: u64, id: u32, claimed: &mut KeySet) -> bool {
        if self
            .contested
            .get(&id)
            .is_some_and(|sums| sums.contains(&sum))
        {
            return false;
        }
        if self.several && claimed.insert(sum) {
            let owner = self.owners.entry(sum).or_insert((id, 0));
            if owner.0 == id {
                owner.1 += 1;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_is_owned_by_the_first_domain_until_its_last_claimant_leaves() {
        let mut domains = Domains::new(SeveralDomains::Allow);
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
            domains.claim(7, b, &mut claims_b),
            "what another domain holds does not decide"
        );
        assert_eq!(domains.owner(7), Some(a));
        assert!(
            !domains.leave("uid 0", &claims_a),
            "the domain keeps a member"
        );
        assert_eq!(domains.owner(7), Some(a), "still owned through a2");
        assert!(domains.leave("uid 0", &claims_a2), "last member gone");
        assert_eq!(domains.count(), 1);
        assert_eq!(
            domains.owner(7),
            None,
            "owned by none once its owner is gone"
        );
        assert!(domains.claim(7, b, &mut claims_b), "b's to mark all along");
        assert!(domains.leave("uid 1000", &claims_b));
        assert_eq!((domains.count(), domains.owned_contents()), (0, 0));
        assert_ne!(domains.join("uid 0"), a, "numbers are never reused");
    }

    #[test]
    fn with_one_domain_at_a_time_claims_are_not_kept() {
        let mut domains = Domains::new(SeveralDomains::Refuse);
        let a = domains.join("uid 0");
        let mut claims = KeySet::default();
        assert!(
            domains.claim(7, a, &mut claims),
            "it is the domain's to mark"
        );
        assert!(claims.is_empty(), "nothing kept for it");
        assert_eq!((domains.owner(7), domains.owned_contents()), (None, 0));
        assert!(domains.leave("uid 0", &claims));
        assert_eq!(domains.count(), 0);
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
    fn a_content_contested_in_one_domain_is_still_the_others_to_mark() {
        let mut domains = Domains::new(SeveralDomains::Allow);
        let (a, b) = (domains.join("uid 0"), domains.join("uid 1000"));
        let (mut claims_a, mut claims_b) = (KeySet::default(), KeySet::default());
        assert!(domains.claim(7, a, &mut claims_a));
        assert_eq!(domains.id_of("uid 0"), Some(a));
        domains.contest(7, b);
        assert!(!domains.claim(7, b, &mut claims_b), "b gave way on it");
        assert!(domains.claim(7, a, &mut claims_a), "a did not");
        assert!(domains.claim(8, b, &mut claims_b), "other contents are b's");
        assert_eq!(domains.contested(), 1);
        assert!(domains.leave("uid 1000", &claims_b));
        assert_eq!(domains.contested(), 0, "forgotten with the domain");
    }
}
