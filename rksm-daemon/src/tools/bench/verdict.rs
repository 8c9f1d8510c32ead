//! The bench's verdicts: where a run stands against the project's published goals.
//!
//! The goals are the table "Goals" of docs/BENCHMARKS.md, and [`GOALS`] is that table here;
//! a test keeps the two the same. Each goal was set on one profile (or on every profile with
//! a share of duplicates) and is judged there, MET or NOT MET; on other profiles its line is
//! shown FOR REFERENCE, with the profile it was set on. A goal whose rows are missing from
//! the run is NOT MEASURED. Only the xxh64 rows are judged.

use rksm_common::PAGE_SIZE;

use super::{MemorySpeed, RunResult};
use crate::tools::workload::Profile;

/// Where the goals are published.
pub const GOALS_DOC: &str = "docs/BENCHMARKS.md#goals";

/// Where a goal is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// On the profile of this name.
    On(&'static str),
    /// On every profile whose share of duplicates (zero pages included) is at most this
    /// many percent.
    Duplicates(u32),
    /// On every profile with more duplicates than that.
    MoreDuplicates(u32),
    /// Wherever its rows are.
    Everywhere,
}

/// One published goal.
#[derive(Debug, Clone, Copy)]
pub struct Goal {
    /// Its id in the table.
    pub id: &'static str,
    /// What it measures.
    pub what: &'static str,
    /// Its bound, as the table writes it.
    pub bound: &'static str,
    /// The bound as a number: the largest ratio or value that meets it ((f): the ratio it
    /// must stay below).
    pub limit: f64,
    /// Where it is judged.
    pub judged: Judged,
}

/// The goals, as docs/BENCHMARKS.md publishes them.
pub const GOALS: [Goal; 9] = [
    Goal {
        id: "a",
        what: "steady state, rksm ebpf + ksmd CPU per minute against ksmd-tuned",
        bound: "at most 1/100",
        limit: 0.01,
        judged: Judged::On("static-4g"),
    },
    Goal {
        id: "b",
        what: "steady pass time against hash-only's, at 16 GiB",
        bound: "at most 1%",
        limit: 0.01,
        judged: Judged::On("quarter-16g"),
    },
    Goal {
        id: "c",
        what: "CPU to 90% of the savings, rksm ebpf + ksmd, against ksmd-tuned",
        bound: "at most 0.6x",
        limit: 0.6,
        judged: Judged::MoreDuplicates(25),
    },
    Goal {
        id: "c",
        what: "CPU to 90% of the savings, rksm ebpf + ksmd, against ksmd-tuned",
        bound: "at most 0.3x",
        limit: 0.3,
        judged: Judged::Duplicates(25),
    },
    Goal {
        id: "c",
        what: "rksm's own part of it, against ksmd-tuned",
        bound: "at most 0.15x",
        limit: 0.15,
        judged: Judged::Everywhere,
    },
    Goal {
        id: "d",
        what: "seconds to 90% of the savings",
        bound: "at most 3.5 s",
        limit: 3.5,
        judged: Judged::On("static"),
    },
    Goal {
        id: "e",
        what: "rksm's resident memory per present page after convergence",
        bound: "at most 24 B",
        limit: 24.0,
        judged: Judged::On("quarter-16g"),
    },
    Goal {
        id: "e",
        what: "rksm's resident memory per present page at its peak",
        bound: "at most 64 B",
        limit: 64.0,
        judged: Judged::On("quarter-16g"),
    },
    Goal {
        id: "f",
        what: "rksm's CPU for its first pass per GB present, against a memcpy of a GB",
        bound: "below 1x",
        limit: 1.0,
        judged: Judged::Duplicates(25),
    },
];

/// The share of a profile's memory that is duplicates (zero pages included), in percent.
fn duplicate_percent(profile: &Profile) -> f64 {
    profile.duplicate_pages() as f64 * 100.0 / profile.mergeable_pages().max(1) as f64
}

/// How goal `goal` is judged on `profile`: its verdict's prefix if met or not, and what to
/// add to its bound when it is only shown for reference there.
fn judge(goal: &Goal, profile: &Profile, met: bool) -> (&'static str, String) {
    let verdict = if met { "MET:" } else { "NOT MET:" };
    let share = duplicate_percent(profile);
    let (applies, elsewhere) = match goal.judged {
        Judged::On(name) => (
            Profile::named(name).as_ref() == Some(profile),
            format!(", set on `{name}`"),
        ),
        Judged::Duplicates(p) => (
            share <= f64::from(p),
            format!(", set for {p}% duplicates or fewer"),
        ),
        Judged::MoreDuplicates(p) => (
            share > f64::from(p),
            format!(", set for more than {p}% duplicates"),
        ),
        Judged::Everywhere => (true, String::new()),
    };
    match applies {
        true => (verdict, String::new()),
        false => ("FOR REFERENCE:", elsewhere),
    }
}

/// The line of goal `goal`: `measured` (what was measured, and the ratio or value compared)
/// and whether it is met.
fn line(goal: &Goal, profile: &Profile, measured: String, met: bool) -> String {
    let (prefix, elsewhere) = judge(goal, profile, met);
    format!(
        "{prefix} ({}) {measured} (goal {}{elsewhere})",
        goal.id, goal.bound
    )
}

/// The report's verdicts on the goals ([`GOALS_DOC`]), one line each, from the xxh64 rows.
pub fn verdicts(runs: &[RunResult], profile: &Profile, memory: Option<MemorySpeed>) -> Vec<String> {
    let find = |mode: &str| {
        runs.iter()
            .find(|r| r.mode == mode && r.checksum == "xxh64")
    };
    let mut lines = Vec::new();
    if profile.is_guests() {
        // Guests that mark their own RAM, where ksmd sweeps all of it whatever rksm does.
        let (Some(ebpf), Some(tuned)) = (find("ebpf"), find("ksmd-tuned")) else {
            return vec!["NOT MEASURED: no ebpf or ksmd-tuned row".into()];
        };
        let verdict = |met: bool| if met { "MET:" } else { "NOT MET:" };
        let whole = |r: &RunResult| r.cpu_seconds + r.ksmd_cpu_seconds;
        let (e, t) = (whole(ebpf), whole(tuned));
        lines.push(format!(
            "{} guests, whole run: rksm ebpf + ksmd {e:.2} CPU s, ksmd-tuned {t:.2} s: {:.2}x (goal below 1x)",
            verdict(e < t),
            e / t.max(1e-9)
        ));
        if let (Some(e), Some(t)) = (ebpf.steady_cpu_per_minute, tuned.steady_cpu_per_minute) {
            lines.push(format!(
                "{} guests, steady state: rksm ebpf + ksmd {e:.2} CPU s/min, ksmd-tuned {t:.2}: {:.2}x (goal below 1x)",
                verdict(e < t),
                e / t.max(1e-9)
            ));
        }
        return lines;
    }
    let Some(ebpf) = find("ebpf") else {
        return vec!["NOT MEASURED: no ebpf row".into()];
    };
    let (hash, tuned) = (find("hash-only"), find("ksmd-tuned"));
    let [a, b, c_many, c_few, c_part, d, e_end, e_peak, f] = &GOALS;

    // (a) Steady state, rksm + ksmd CPU per minute; hash-only's for reference.
    match (
        ebpf.steady_cpu_per_minute,
        tuned.and_then(|r| r.steady_cpu_per_minute),
    ) {
        (Some(e), Some(t)) => lines.push(line(
            a,
            profile,
            format!(
                "steady state: rksm ebpf + ksmd {e:.2} CPU s/min, ksmd-tuned {t:.2}: 1/{:.0}",
                t / e.max(1e-9)
            ),
            e <= a.limit * t,
        )),
        _ => lines.push("NOT MEASURED: (a) steady state against ksmd-tuned".into()),
    }
    if let (Some(e), Some(h)) = (
        ebpf.steady_cpu_per_minute,
        hash.and_then(|r| r.steady_cpu_per_minute),
    ) {
        lines.push(format!(
            "FOR REFERENCE: steady state: rksm ebpf + ksmd {e:.2} CPU s/min, hash-only {h:.2}: 1/{:.0}",
            h / e.max(1e-9)
        ));
    }
    // (b) Steady pass time.
    match (
        ebpf.steady_pass_seconds,
        hash.and_then(|h| h.steady_pass_seconds),
    ) {
        (Some(e), Some(h)) => lines.push(line(
            b,
            profile,
            format!(
                "steady pass: ebpf {:.1} ms, hash-only {:.1} ms: {:.2}%",
                e * 1e3,
                h * 1e3,
                e / h.max(1e-9) * 100.0
            ),
            e <= b.limit * h,
        )),
        _ => lines.push("NOT MEASURED: (b) steady pass against hash-only".into()),
    }
    // (c) CPU to 90% of the savings, rksm's part of it, and the floor ksmd's part sets.
    let c = if duplicate_percent(profile) > 25.0 {
        c_many
    } else {
        c_few
    };
    match (ebpf.cpu_to_90pct, tuned.and_then(|r| r.cpu_to_90pct)) {
        (Some(cpu), Some(t)) => {
            let ksmd_part = ebpf.ksmd_cpu_to_90pct.map_or(String::new(), |k| {
                format!("; ksmd's part {k:.2} s ({:.2}x)", k / t.max(1e-9))
            });
            lines.push(line(
                c,
                profile,
                format!(
                    "CPU to 90% of the savings: rksm ebpf + ksmd {cpu:.2} s, ksmd-tuned {t:.2} s: {:.2}x with {:.0}% duplicates{ksmd_part}",
                    cpu / t.max(1e-9),
                    duplicate_percent(profile)
                ),
                cpu <= c.limit * t,
            ));
            if let Some(k) = ebpf.ksmd_cpu_to_90pct {
                let own = ebpf.rksm_cpu_to_90pct.unwrap_or((cpu - k).max(0.0));
                lines.push(line(
                    c_part,
                    profile,
                    format!(
                        "rksm's part of it: {own:.2} s, {:.2}x of ksmd-tuned",
                        own / t.max(1e-9)
                    ),
                    own <= c_part.limit * t,
                ));
            }
        }
        _ => lines.push("NOT MEASURED: (c) rksm ebpf or ksmd-tuned did not reach 90% of the achievable savings within the run".into()),
    }
    // What merging the duplicates costs ksmd when nothing has to find them.
    let told = find("ksmd-duplicates").and_then(|r| r.cpu_to_90pct);
    if let (Some(k), Some(t)) = (told, tuned.and_then(|r| r.cpu_to_90pct)) {
        lines.push(format!(
            "FOR REFERENCE: (c) ksmd told only the duplicates: {k:.2} CPU s to 90% of the savings, {:.2}x of ksmd-tuned (the floor under any design that leaves the merge to ksmd)",
            k / t.max(1e-9)
        ));
    }
    // (d) Convergence.
    let to_90 = ebpf.seconds_to_90pct;
    let tuned_90 = tuned
        .and_then(|r| r.seconds_to_90pct)
        .map_or(String::new(), |k| format!(", ksmd-tuned in {k:.1} s"));
    lines.push(match to_90 {
        Some(s) => line(
            d,
            profile,
            format!("rksm ebpf reached 90% of the savings in {s:.1} s{tuned_90}"),
            s <= d.limit,
        ),
        None => line(
            d,
            profile,
            "rksm ebpf never reached 90% of the savings".into(),
            false,
        ),
    });
    // (e) Resident memory per present page.
    match (ebpf.rss_bytes_per_page, ebpf.peak_rss_bytes_per_page) {
        (Some(end), Some(peak)) => {
            lines.push(line(
                e_end,
                profile,
                format!("rksm's resident memory after convergence: {end:.1} B a page"),
                end <= e_end.limit,
            ));
            lines.push(line(
                e_peak,
                profile,
                format!("rksm's resident memory at its peak: {peak:.1} B a page"),
                peak <= e_peak.limit,
            ));
        }
        _ => lines.push("NOT MEASURED: (e) rksm's resident memory".into()),
    }
    // (f) The first pass's CPU per GB present, against this machine's memcpy.
    match (ebpf.first_pass_cpu, ebpf.first_pass_pages, memory) {
        (Some(cpu), Some(pages), Some(memory)) if pages > 0 && memory.memcpy_gbps > 0.0 => {
            let gb = pages as f64 * PAGE_SIZE as f64 / 1e9;
            let per_gb = cpu / gb;
            let memcpy_per_gb = 1.0 / memory.memcpy_gbps;
            lines.push(line(
                f,
                profile,
                format!(
                    "first pass: rksm ebpf {per_gb:.3} CPU s per GB present ({cpu:.2} s for {gb:.2} GB, start-up included), memcpy {memcpy_per_gb:.3} s per GB here{}: {:.2}x",
                    memory
                        .process_vm_readv_gbps
                        .map_or(String::new(), |r| format!(" (process_vm_readv {:.3})", 1.0 / r)),
                    per_gb / memcpy_per_gb
                ),
                per_gb < f.limit * memcpy_per_gb,
            ));
        }
        _ => lines.push("NOT MEASURED: (f) first pass against memcpy".into()),
    }
    if let Some(hash) = hash {
        lines.push(format!(
            "FOR REFERENCE: ebpf hashes {:.2}% of what hash-only hashes per steady pass ({} vs {} pages)",
            ebpf.pages_hashed as f64 / hash.pages_hashed.max(1) as f64 * 100.0,
            ebpf.pages_hashed,
            hash.pages_hashed
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::super::tests::run;
    use super::*;

    /// Memory speeds as `memory_speed` reports them: `memcpy` GB/s, and 3/4 of it read out.
    fn memory(memcpy: f64) -> Option<MemorySpeed> {
        Some(MemorySpeed {
            memcpy_gbps: memcpy,
            process_vm_readv_gbps: Some(memcpy * 0.75),
        })
    }

    fn profile(name: &str) -> Profile {
        Profile::named(name).unwrap()
    }

    /// The rows of a run: ksmd-tuned, hash-only and ebpf (xxh64), and an ebpf crc32c row
    /// that must never be judged.
    fn rows() -> Vec<RunResult> {
        let mut ebpf = run("ebpf", "xxh64", 40, Some(4.0), Some(1.0));
        ebpf.ksmd_cpu_to_90pct = Some(0.6);
        ebpf.rksm_cpu_to_90pct = Some(0.4);
        ebpf.rss_bytes_per_page = Some(40.0);
        ebpf.peak_rss_bytes_per_page = Some(60.0);
        ebpf.first_pass_cpu = Some(0.5);
        ebpf.first_pass_pages = Some(1_000_000);
        ebpf.steady_cpu_per_minute = Some(0.05);
        vec![
            run("ksmd", "xxh64", 5000, Some(25.0), Some(3.0)),
            run("ksmd-tuned", "xxh64", 5000, Some(3.0), Some(3.0)),
            run("hash-only", "xxh64", 5000, Some(3.0), Some(2.0)),
            ebpf,
            run("ebpf", "crc32c", 4000, Some(9.0), Some(9.0)),
        ]
    }

    #[test]
    fn ksmd_told_the_duplicates_is_shown_after_c_as_its_floor() {
        let mut runs = rows();
        runs.push(run("ksmd-duplicates", "xxh64", 5000, Some(2.0), Some(1.5)));
        let v = verdicts(&runs, &profile("static-4g"), memory(10.0));
        assert_eq!(
            v[5],
            "FOR REFERENCE: (c) ksmd told only the duplicates: 1.50 CPU s to 90% of the savings, 0.50x of ksmd-tuned (the floor under any design that leaves the merge to ksmd)"
        );
        assert!(v[6].contains("(d)"), "{v:?}");
        // Not measured, not shown.
        let v = verdicts(&rows(), &profile("static-4g"), memory(10.0));
        assert!(!v.iter().any(|l| l.contains("told only")), "{v:?}");
    }

    #[test]
    fn each_goal_is_judged_on_its_profile_and_shown_for_reference_elsewhere() {
        let runs = rows();
        let v = verdicts(&runs, &profile("static-4g"), memory(10.0));
        assert_eq!(
            v[0],
            "NOT MET: (a) steady state: rksm ebpf + ksmd 0.05 CPU s/min, ksmd-tuned 3.00: 1/60 (goal at most 1/100)"
        );
        assert_eq!(
            v[1],
            "FOR REFERENCE: steady state: rksm ebpf + ksmd 0.05 CPU s/min, hash-only 2.00: 1/40"
        );
        assert_eq!(
            v[2],
            "FOR REFERENCE: (b) steady pass: ebpf 0.4 ms, hash-only 50.0 ms: 0.80% (goal at most 1%, set on `quarter-16g`)"
        );
        // static-4g has more than 25% duplicates: the 0.6x bound.
        assert_eq!(
            v[3],
            "MET: (c) CPU to 90% of the savings: rksm ebpf + ksmd 1.00 s, ksmd-tuned 3.00 s: 0.33x with 50% duplicates; ksmd's part 0.60 s (0.20x) (goal at most 0.6x)"
        );
        assert_eq!(
            v[4],
            "MET: (c) rksm's part of it: 0.40 s, 0.13x of ksmd-tuned (goal at most 0.15x)"
        );
        assert_eq!(
            v[5],
            "FOR REFERENCE: (d) rksm ebpf reached 90% of the savings in 4.0 s, ksmd-tuned in 3.0 s (goal at most 3.5 s, set on `static`)"
        );
        assert_eq!(
            v[6],
            "FOR REFERENCE: (e) rksm's resident memory after convergence: 40.0 B a page (goal at most 24 B, set on `quarter-16g`)"
        );
        assert!(v[7].starts_with("FOR REFERENCE: (e) rksm's resident memory at its peak: 60.0 B"));
        assert!(
            v[8].starts_with("FOR REFERENCE: (f) first pass: rksm ebpf 0.122 CPU s per GB present (0.50 s for 4.10 GB, start-up included), memcpy 0.100 s per GB here (process_vm_readv 0.133): 1.22x (goal below 1x, set for 25% duplicates or fewer)"),
            "{v:?}"
        );
        assert_eq!(
            v[9],
            "FOR REFERENCE: ebpf hashes 0.80% of what hash-only hashes per steady pass (40 vs 5000 pages)"
        );
        assert_eq!(v.len(), 10);

        // A 25% profile: the 0.3x bound for (c), and (f) judged.
        let q = verdicts(&runs, &profile("quarter-4g"), memory(10.0));
        assert!(
            q[3].starts_with("NOT MET: (c) CPU to 90%") && q[3].ends_with("(goal at most 0.3x)"),
            "{q:?}"
        );
        assert!(
            q[8].starts_with("NOT MET: (f)") && q[8].ends_with("(goal below 1x)"),
            "{q:?}"
        );
        let fast = verdicts(&runs, &profile("quarter-4g"), memory(5.0));
        assert!(fast[8].starts_with("MET: (f)"), "{fast:?}");
        // (b) and (e) judged on the 16 GiB profile only.
        let big = verdicts(&runs, &profile("quarter-16g"), memory(10.0));
        assert!(
            big[2].starts_with("MET: (b) steady pass") && big[2].ends_with("(goal at most 1%)")
        );
        assert!(big[6].starts_with("NOT MET: (e)") && big[6].ends_with("(goal at most 24 B)"));
        assert!(big[7].starts_with("MET: (e)") && big[7].ends_with("(goal at most 64 B)"));
        // (d) on static.
        let st = verdicts(&runs, &profile("static"), memory(10.0));
        assert!(st[5].starts_with("NOT MET: (d) rksm ebpf reached 90% of the savings in 4.0 s"));
    }

    #[test]
    fn a_goal_without_its_rows_is_not_measured() {
        let runs = rows();
        let p = profile("static-4g");
        assert_eq!(
            verdicts(&runs[..2], &p, memory(10.0)),
            ["NOT MEASURED: no ebpf row"]
        );
        let v = verdicts(&[runs[1].clone(), runs[3].clone()], &p, None);
        assert!(v[0].starts_with("NOT MET: (a)"), "{v:?}");
        assert_eq!(v[1], "NOT MEASURED: (b) steady pass against hash-only");
        assert!(v[2].starts_with("MET: (c) CPU to 90%"), "{v:?}");
        assert_eq!(
            v.last().unwrap(),
            "NOT MEASURED: (f) first pass against memcpy"
        );
        let only_ebpf = verdicts(&runs[3..4], &p, memory(10.0));
        assert_eq!(
            only_ebpf[0],
            "NOT MEASURED: (a) steady state against ksmd-tuned"
        );
        assert!(only_ebpf.contains(&"NOT MEASURED: (c) rksm ebpf or ksmd-tuned did not reach 90% of the achievable savings within the run".to_string()));
    }

    #[test]
    fn the_goals_are_the_ones_the_docs_publish() {
        let doc = include_str!("../../../../docs/BENCHMARKS.md");
        let table = doc
            .split("## Goals")
            .nth(1)
            .expect("docs/BENCHMARKS.md has a Goals section");
        for goal in &GOALS {
            let row = format!("| ({}) | {} | {} |", goal.id, goal.what, goal.bound);
            assert!(
                table.contains(&row),
                "docs/BENCHMARKS.md lacks the row {row}"
            );
        }
    }
}
