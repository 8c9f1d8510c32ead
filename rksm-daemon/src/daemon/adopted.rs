//! A target as the daemon holds it: the engine's record, and the daemon's policy for it.
//!
//! The engine's [`Target`] says what is true of a process: its pages, what is marked and
//! merged in it, its verified duplicates. What the daemon decides about it is kept here, next
//! to it and dropped with it: which contents its merge domain has claimed (so that a domain
//! that leaves gives them up; kept only where several domains are allowed), and which regions
//! are backed off because their merges keep breaking. The record lends its target wherever
//! the engine takes one.

use std::ops::{Deref, DerefMut};

use super::backoff::Backoff;
use crate::engine::{keys::KeySet, target::Target};

/// One adopted process.
#[derive(Debug)]
pub(super) struct Adopted {
    target: Target,
    /// Contents (by checksum) it has marked or has merged: its domain owns them.
    owned: KeySet,
    /// Regions whose merged pages keep breaking.
    backoff: Backoff,
}

impl Adopted {
    /// Holds `target`, with nothing claimed and nothing backed off.
    pub(super) fn new(target: Target) -> Self {
        Adopted {
            target,
            owned: KeySet::default(),
            backoff: Backoff::default(),
        }
    }

    /// The contents its domain claimed through it.
    pub(super) fn owned(&self) -> &KeySet {
        &self.owned
    }

    /// The contents its domain claimed through it, to claim more.
    pub(super) fn owned_mut(&mut self) -> &mut KeySet {
        &mut self.owned
    }

    /// Its back-off.
    pub(super) fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// Its back-off, to update.
    pub(super) fn backoff_mut(&mut self) -> &mut Backoff {
        &mut self.backoff
    }
}

/// The record is read as its target wherever a target is wanted.
impl Deref for Adopted {
    type Target = Target;

    fn deref(&self) -> &Target {
        &self.target
    }
}

impl DerefMut for Adopted {
    fn deref_mut(&mut self) -> &mut Target {
        &mut self.target
    }
}
