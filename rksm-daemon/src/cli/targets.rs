//! The target-selection flags shared by every command that works on processes.

use std::{path::PathBuf, time::Duration};

use clap::Args;
use regex::Regex;
use rksm::{
    engine::targets::{Selection, SelectionError, TargetSpec},
    service::config::{ConfigFile, Seconds},
};

use super::BadInput;

/// Which processes to work on: --pid always; --cgroup, --uid and --all add up, and --comm
/// narrows them (or, alone, selects by name); --min-age then filters.
#[derive(Debug, Args, Clone)]
pub struct TargetArgs {
    /// A process (repeatable); it must exist.
    #[arg(long = "pid", value_name = "PID", value_parser = clap::value_parser!(u32).range(1..))]
    pids: Vec<u32>,
    /// Every process in this cgroup (v1 or v2) and the cgroups below it; absolute, or
    /// relative to /sys/fs/cgroup (repeatable).
    #[arg(long = "cgroup", value_name = "PATH")]
    cgroups: Vec<PathBuf>,
    /// Every process all of whose user ids (real, effective, saved, filesystem) are this one
    /// (repeatable).
    #[arg(long = "uid", value_name = "UID")]
    uids: Vec<u32>,
    /// Only processes whose command name matches this regular expression. Alone, it selects
    /// every such process: any user can name a process so.
    #[arg(long, value_name = "REGEX", value_parser = parse_regex)]
    comm: Option<Regex>,
    /// Every user process (not kernel threads, not rksm itself).
    #[arg(long)]
    all: bool,
    /// Only processes running for at least this many seconds.
    #[arg(long, value_name = "SECS", value_parser = |s: &str| Seconds::AGE.parse(s))]
    min_age: Option<f64>,
}

fn parse_regex(s: &str) -> Result<Regex, String> {
    Regex::new(s).map_err(|e| {
        format!(
            "not a valid regular expression: {}",
            e.to_string().lines().last().unwrap_or("")
        )
    })
}

impl TargetArgs {
    /// The selection these flags describe.
    pub fn spec(&self) -> TargetSpec {
        TargetSpec {
            pids: self.pids.clone(),
            cgroups: self.cgroups.clone(),
            uids: self.uids.clone(),
            comm: self.comm.clone(),
            all: self.all,
            min_age: self.min_age.map(Duration::from_secs_f64),
            tree_of: None,
        }
    }

    /// The selection these flags describe, or the configuration file's if they select
    /// nothing (`--min-age` still wins over the file's `min_age`).
    pub fn spec_or(&self, file: &ConfigFile) -> TargetSpec {
        let mut spec = self.spec();
        if spec.is_empty() {
            spec.pids = file.pid.clone();
            spec.cgroups = file.cgroup.clone();
            spec.uids = file.uid.clone();
            spec.comm = file.comm.clone();
            spec.all = file.all == Some(true);
        }
        spec.min_age = spec.min_age.or(file.min_age.map(Duration::from_secs_f64));
        spec
    }

    /// Resolves the selection; every error is the operator's input (exit status 2).
    pub fn resolve(&self) -> anyhow::Result<Selection> {
        let selection = self
            .spec()
            .resolve()
            .map_err(|e: SelectionError| BadInput(e.to_string()))?;
        for (pid, comm, reason) in &selection.refused {
            log::info!("not touching pid {pid} ({comm}): {reason}");
        }
        Ok(selection)
    }
}
