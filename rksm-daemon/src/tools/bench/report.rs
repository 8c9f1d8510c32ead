//! The bench's report: its rows as Markdown tables, closed by the verdicts on the goals, and
//! an SVG plot of `pages_sharing` and CPU over time, one line per run.

use super::{verdict, Machine, MemorySpeed, RunResult, Sample};
use crate::tools::workload::Profile;

/// The Markdown table of a comparison.
pub fn markdown(
    runs: &[RunResult],
    profile: &Profile,
    command: &str,
    machine: &Machine,
    memory: Option<MemorySpeed>,
) -> String {
    let mut md = String::new();
    md.push_str(&format!(
        "Command: `{command}`\n\nMachine: {}\n\nProfile: {}\n\n",
        machine.line(),
        serde_json::to_string(profile).unwrap_or_default()
    ));
    md.push_str("| mode | checksum | pages_sharing | pages hashed / pass | rksm CPU s | ksmd CPU s | s to 90% | CPU s to 90% | of which ksmd | steady CPU s/min (rksm+ksmd) | steady rksm CPU s/min | steady pass ms | CoW breaks | checksum ns/page | pages_unshared | unshared/sharing | integrity |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    let opt =
        |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |x| format!("{x:.digits$}"));
    for r in runs {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.3} | {} |\n",
            r.mode,
            r.checksum,
            r.pages_sharing,
            r.pages_hashed,
            r.cpu_seconds,
            r.ksmd_cpu_seconds,
            opt(r.seconds_to_90pct, 1),
            opt(r.cpu_to_90pct, 2),
            opt(r.ksmd_cpu_to_90pct, 2),
            opt(r.steady_cpu_per_minute, 2),
            opt(r.steady_rksm_cpu_per_minute, 2),
            opt(r.steady_pass_seconds.map(|s| s * 1e3), 1),
            r.cow_breaks.map_or("-".into(), |c| c.to_string()),
            opt(r.checksum_ns_per_page, 0),
            r.pages_unshared,
            r.unshared_per_sharing,
            if r.integrity_ok { "ok" } else { "FAILED" }
        ));
    }
    md.push('\n');
    let rksm_rows: Vec<&RunResult> = runs.iter().filter(|r| r.write_protect.is_some()).collect();
    if !rksm_rows.is_empty() {
        md.push_str("| mode | checksum | write protection (targets) | pages hashed / steady pass | written bits read / steady pass | rksm CPU ms / steady pass | soft-dirty clears | ms per clear | first pass CPU s | rksm RSS B/page (end, peak) |\n");
        md.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        for r in rksm_rows {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {}, {} |\n",
                r.mode,
                r.checksum,
                r.write_protect.as_deref().unwrap_or("-"),
                r.pages_hashed,
                r.written_bits_read.map_or("-".into(), |n| n.to_string()),
                opt(r.steady_rksm_cpu_per_pass.map(|s| s * 1e3), 2),
                r.soft_dirty_clears.map_or("-".into(), |n| n.to_string()),
                opt(r.ms_per_clear, 3),
                opt(r.first_pass_cpu, 2),
                opt(r.rss_bytes_per_page, 1),
                opt(r.peak_rss_bytes_per_page, 1),
            ));
        }
        md.push('\n');
    }
    for line in verdict::verdicts(runs, profile, memory) {
        md.push_str(&format!("- {line}\n"));
    }
    md
}

/// An SVG plot: pages_sharing (top) and rksm + ksmd CPU seconds (bottom) over time, per run.
pub fn svg(runs: &[RunResult]) -> String {
    const W: f64 = 900.0;
    const H: f64 = 260.0;
    const COLORS: [&str; 8] = [
        "#d62728", "#ff7f0e", "#1f77b4", "#17becf", "#2ca02c", "#98df8a", "#9467bd", "#c5b0d5",
    ];
    let t_max = runs
        .iter()
        .flat_map(|r| r.samples.last())
        .map(|s| s.t)
        .fold(1.0, f64::max);
    let y_max = runs
        .iter()
        .flat_map(|r| r.samples.iter())
        .map(|s| s.pages_sharing as f64)
        .fold(1.0, f64::max);
    let c_max = runs
        .iter()
        .flat_map(|r| r.samples.iter())
        .map(|s| s.rksm_cpu + s.ksmd_cpu)
        .fold(0.01, f64::max);
    let mut out = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n", W + 220.0, 2.0 * H + 100.0);
    let panel = |out: &mut String,
                 top: f64,
                 title: &str,
                 max: f64,
                 value: &dyn Fn(&Sample) -> f64| {
        out.push_str(&format!(
            "<text x=\"60\" y=\"{}\">{title} (max {max:.1})</text>\n",
            top - 6.0
        ));
        out.push_str(&format!("<rect x=\"60\" y=\"{top}\" width=\"{W}\" height=\"{H}\" fill=\"none\" stroke=\"#888\"/>\n"));
        for (i, r) in runs.iter().enumerate() {
            let points: Vec<String> = r
                .samples
                .iter()
                .map(|s| {
                    format!(
                        "{:.1},{:.1}",
                        60.0 + s.t / t_max * W,
                        top + H - value(s) / max * H
                    )
                })
                .collect();
            out.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                COLORS[i % COLORS.len()],
                points.join(" ")
            ));
        }
    };
    panel(&mut out, 30.0, "pages_sharing", y_max, &|s| {
        s.pages_sharing as f64
    });
    panel(
        &mut out,
        H + 70.0,
        "CPU seconds, rksm + ksmd",
        c_max,
        &|s| s.rksm_cpu + s.ksmd_cpu,
    );
    out.push_str(&format!(
        "<text x=\"60\" y=\"{}\">0 s</text><text x=\"{}\" y=\"{}\">{t_max:.0} s</text>\n",
        2.0 * H + 92.0,
        W + 30.0,
        2.0 * H + 92.0
    ));
    for (i, r) in runs.iter().enumerate() {
        out.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{}\">{} {}</text>\n",
            W + 70.0,
            40.0 + 16.0 * i as f64,
            COLORS[i % COLORS.len()],
            r.mode,
            r.checksum
        ));
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::super::tests::run;
    use super::*;

    #[test]
    fn the_plot_has_a_line_per_run() {
        let runs = [
            run("ksmd", "xxh64", 1, None, None),
            run("ebpf", "xxh64", 1, None, None),
        ];
        let svg = svg(&runs);
        assert_eq!(svg.matches("<polyline").count(), 4, "two panels, two runs");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
