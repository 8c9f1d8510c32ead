//! Flags, subcommands and how each maps onto the library.

use std::path::PathBuf;

use clap::{CommandFactory, Parser, Subcommand};
use rksm::service::config::{check_log_filter, ConfigFile, LogFormat, ValueError};

mod bench;
mod daemon;
mod estimate;
mod logging;
mod status;
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
    /// Log level or filter: error, warn, info, debug, trace, or TARGET=LEVEL directives,
    /// comma-separated [default: RUST_LOG, else the configuration file's, else info].
    #[arg(long, global = true, value_name = "FILTER", value_parser = parse_log_filter, display_order = 900)]
    log_level: Option<String>,
    /// Log lines as text or as JSON objects [default: the configuration file's, else text].
    #[arg(long, global = true, value_name = "text|json", display_order = 901)]
    log_format: Option<LogFormat>,
    /// Read no configuration file unless --config names one: /etc/rksm/rksm.toml is ignored
    /// (`rksm bench`, the demo and the tests use this, so a host's settings do not change
    /// what they measure).
    #[arg(long, global = true, display_order = 902)]
    no_config: bool,
}

fn parse_log_filter(s: &str) -> Result<String, ValueError> {
    check_log_filter(s).map(|()| s.to_string())
}

#[derive(Debug, Subcommand)]
enum Command {
    Trace(trace::TraceArgs),
    Estimate(estimate::EstimateArgs),
    Daemon(daemon::DaemonArgs),
    Run(daemon::RunArgs),
    Status(status::StatusArgs),
    Bench(bench::BenchArgs),
    Workload(bench::WorkloadArgs),
    Completions(CompletionsArgs),
    Man(ManArgs),
}

/// Print shell completions for rksm.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  rksm completions bash > /etc/bash_completion.d/rksm\n  rksm completions zsh > /usr/local/share/zsh/site-functions/_rksm\n  rksm completions fish > ~/.config/fish/completions/rksm.fish"
)]
struct CompletionsArgs {
    /// The shell.
    #[arg(value_name = "bash|zsh|fish")]
    shell: Shell,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Shell {
    Bash,
    Zsh,
    Fish,
}

/// Print rksm's man page (roff), generated from the same definitions as --help.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  rksm man > /usr/local/share/man/man1/rksm.1 && man rksm\n  rksm man --out-dir /usr/local/share/man/man1   # rksm.1 and rksm-SUBCOMMAND.1"
)]
struct ManArgs {
    /// Write rksm.1 and one page per subcommand into this directory instead.
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
}

/// SIGINT and SIGTERM, blocked and delivered to a signalfd instead, so that a command's one
/// poll loop (the daemon's wait between passes, `rksm trace`'s) sees them with everything
/// else it waits for. Call before any thread starts: threads inherit the mask.
fn termination_signals() -> anyhow::Result<nix::sys::signalfd::SignalFd> {
    use anyhow::Context;
    use nix::sys::{
        signal::{SigSet, Signal},
        signalfd::{SfdFlags, SignalFd},
    };
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGINT);
    mask.add(Signal::SIGTERM);
    mask.thread_block().context("blocking SIGINT and SIGTERM")?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC).context("signalfd")
}

/// Runs the parsed command: reads the configuration file (for the commands that have one),
/// starts logging, checks that rksm has the privileges the command needs, and runs it.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    use rksm::kernel::caps::{require, Capability::*};
    let config_flag = match &cli.command {
        Command::Daemon(args) => Some(args.options.config.as_deref()),
        Command::Run(args) => Some(args.options.config.as_deref()),
        Command::Status(args) => Some(args.config.as_deref()),
        _ => None,
    };
    let (file, used) = match config_flag {
        Some(None) if cli.no_config => (ConfigFile::default(), None),
        Some(flag) => ConfigFile::load(flag).map_err(|e| BadInput(e.to_string()))?,
        None => (ConfigFile::default(), None),
    };
    logging::init(
        &logging::filter(cli.log_level.as_deref(), file.log_level.as_deref()),
        cli.log_format.or(file.log_format).unwrap_or_default(),
    );
    if let Some(path) = used {
        log::debug!("configuration from {}", path.display());
    }
    match &cli.command {
        Command::Trace(_) => require(&[Bpf, Perfmon])?,
        Command::Estimate(_) => require(&[SysPtrace, SysAdmin, DacReadSearch])?,
        Command::Daemon(_) | Command::Run(_) | Command::Bench(_) => {
            require(&[SysPtrace, SysAdmin, Bpf, Perfmon, DacReadSearch])?;
            // Where targets may be write-protected with soft-dirty: their clear_refs.
            if rksm::kernel::softdirty::supported() {
                require(&[DacOverride])?;
            }
        }
        Command::Status(_) | Command::Workload(_) | Command::Completions(_) | Command::Man(_) => {}
    }
    match cli.command {
        Command::Trace(args) => trace::run(args),
        Command::Estimate(args) => estimate::run(args),
        Command::Daemon(args) => daemon::run_daemon(args, &file),
        Command::Run(args) => daemon::run_command(args, &file),
        Command::Status(args) => status::run(args, &file),
        Command::Bench(args) => bench::run_bench(args),
        Command::Workload(args) => bench::run_workload(args),
        Command::Completions(args) => {
            let shell = match args.shell {
                Shell::Bash => clap_complete::Shell::Bash,
                Shell::Zsh => clap_complete::Shell::Zsh,
                Shell::Fish => clap_complete::Shell::Fish,
            };
            clap_complete::generate(shell, &mut Cli::command(), "rksm", &mut std::io::stdout());
            Ok(())
        }
        Command::Man(args) => man(args.out_dir),
    }
}

fn man(out_dir: Option<PathBuf>) -> anyhow::Result<()> {
    use anyhow::Context;
    let command = Cli::command();
    let Some(dir) = out_dir else {
        clap_mangen::Man::new(command).render(&mut std::io::stdout())?;
        return Ok(());
    };
    clap_mangen::generate_to(command, &dir).with_context(|| format!("{}", dir.display()))?;
    Ok(())
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
                    "trace", "estimate", "daemon", "run", "bench", "workload", "status", "completions",
                    "man", "--config", "--log-level", "--log-format", "--socket", "--metrics-address",
                    "--pid", "--cgroup", "--uid", "--several-domains",
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
