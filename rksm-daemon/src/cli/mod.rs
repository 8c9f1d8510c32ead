//! Flags, subcommands and how each maps onto the library.

use std::io::Write;

use clap::{Parser, Subcommand};

mod bench;
mod daemon;
mod estimate;
mod targets;
mod trace;

/// An error in what the user asked for (as opposed to a failure doing it): exit status 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// rksm: deduplicate identical anonymous memory across processes, rehashing only the pages an
/// eBPF write-fault tracer saw written.
#[derive(Debug, Parser)]
#[command(
    name = "rksm",
    version,
    about,
    long_about = None,
    propagate_version = true,
    after_help = "Example:\n  sudo rksm trace --pid 1234 --duration 10"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Trace(trace::TraceArgs),
    Estimate(estimate::EstimateArgs),
    Daemon(daemon::DaemonArgs),
    Run(daemon::RunArgs),
    Bench(bench::BenchArgs),
    Workload(bench::WorkloadArgs),
}

/// Runs the parsed command, after checking that rksm has the privileges it needs for it.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    use rksm::caps::{require, Capability::*};
    match &cli.command {
        Command::Trace(_) => require(&[Bpf, Perfmon])?,
        Command::Estimate(_) => require(&[SysPtrace, SysAdmin])?,
        Command::Daemon(_) | Command::Run(_) | Command::Bench(_) => {
            require(&[SysPtrace, SysAdmin, Bpf, Perfmon])?
        }
        Command::Workload(_) => {}
    }
    match cli.command {
        Command::Trace(args) => trace::run(args),
        Command::Estimate(args) => estimate::run(args),
        Command::Daemon(args) => daemon::run_daemon(args),
        Command::Run(args) => daemon::run_command(args),
        Command::Bench(args) => bench::run_bench(args),
        Command::Workload(args) => bench::run_workload(args),
    }
}

/// Logs go to stderr; `RUST_LOG` sets the level (default `info`). The eBPF program's own log
/// lines arrive through the same logger, under the target `rksm`.
pub fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| {
            writeln!(
                buf,
                "rksm: {}: {}",
                record.level().as_str().to_lowercase(),
                record.args()
            )
        })
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy;

    proptest::proptest! {
        /// Any argument list, built from real flags, values that are almost right, and noise:
        /// clap either parses it or returns an error; nothing panics.
        #[test]
        fn argument_parsing_never_panics(args in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::sample::select(vec![
                    "trace", "estimate", "daemon", "run", "bench", "workload", "--pid", "--cgroup",
                    "--comm", "--all", "--min-age", "--dirty", "--checksum", "--interval", "--duration",
                    "--passes", "--json", "--profile", "--quick", "--out", "--", "-h", "0", "1", "-1",
                    "4294967296", "nan", "inf", "1e999", "xxh64", "crc32c", "ebpf", "(", "",
                ]).prop_map(String::from),
                "\\PC{0,12}",
            ],
            0..8,
        )) {
            let _ = Cli::try_parse_from(std::iter::once("rksm".to_string()).chain(args));
        }
    }

    #[test]
    fn every_subcommand_has_an_example_in_its_help() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        for sub in cli.get_subcommands_mut() {
            let help = sub.render_long_help().to_string();
            assert!(
                help.contains("Example:"),
                "{} --help has no example",
                sub.get_name()
            );
        }
    }
}
