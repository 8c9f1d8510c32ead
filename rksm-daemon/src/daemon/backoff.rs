//! Copy-on-write back-off: where merged pages keep breaking, rksm stops marking for a while.
//!
//! A merged page that is written is copied again by the kernel; marking it anew would have
//! ksmd merge it again, and the next write break it again, each round costing both of them.
//! So a 2 MiB region whose merged pages broke is not marked for a few passes, and for twice
//! as long each time it happens again. This is the daemon's policy, kept per target next to
//! the engine's record (see [`super::adopted`]).

use std::collections::HashMap;

/// Per-region copy-on-write back-off: a 2 MiB region whose merged pages broke is not marked
/// again for a while, and the while doubles each time it happens again.
#[derive(Debug, Default)]
pub struct Backoff {
    /// Region number → (backed off until pass, length of the last back-off).
    regions: HashMap<u64, (u64, u64)>,
}

/// Back-off regions are 2 MiB.
pub const REGION_SHIFT: u32 = 21;
const FIRST_BACKOFF_PASSES: u64 = 4;
const MAX_BACKOFF_PASSES: u64 = 256;

impl Backoff {
    /// Backs `region` off from pass `now`; returns true if it was not already.
    pub fn hit(&mut self, region: u64, now: u64) -> bool {
        let entry = self
            .regions
            .entry(region)
            .or_insert((0, FIRST_BACKOFF_PASSES / 2));
        let fresh = entry.0 <= now;
        if fresh {
            entry.1 = (entry.1 * 2).min(MAX_BACKOFF_PASSES);
            entry.0 = now + entry.1;
        }
        fresh
    }

    /// Whether `page` is in a region backed off at pass `now`.
    pub fn blocks(&self, page: u64, now: u64) -> bool {
        self.regions
            .get(&(page >> REGION_SHIFT))
            .is_some_and(|&(until, _)| until > now)
    }

    /// Regions backed off at pass `now`.
    pub fn active(&self, now: u64) -> u64 {
        self.regions
            .values()
            .filter(|&&(until, _)| until > now)
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_expires() {
        let mut backoff = Backoff::default();
        assert!(backoff.hit(7, 0));
        assert!(backoff.blocks(7 << REGION_SHIFT, 3));
        assert!(
            !backoff.blocks(7 << REGION_SHIFT, 4),
            "first backoff is {FIRST_BACKOFF_PASSES} passes"
        );
        assert!(!backoff.hit(7, 2), "already backed off");
        assert!(backoff.hit(7, 10));
        assert!(
            backoff.blocks(7 << REGION_SHIFT, 17),
            "second is twice as long"
        );
        assert!(!backoff.blocks(7 << REGION_SHIFT, 18));
        assert!(!backoff.blocks(8 << REGION_SHIFT, 11), "per region");
        assert_eq!(backoff.active(11), 1);
    }
}
