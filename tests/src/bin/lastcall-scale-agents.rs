//! `lastcall-scale-agents`: one shard of the scale harness's agents in a process of its own
//! (see `lastcall_testkit::scale_agents`). Started by the harness, not by hand.
#![forbid(unsafe_code)]

use clap::Parser;
use lastcall_testkit::scale_agents::{ShardSpec, run, run_on_two_workers};

#[derive(Parser, Debug)]
#[command(
    name = "lastcall-scale-agents",
    about = "Runs agents from..to of a scale world in this process until stdin closes"
)]
struct Args {
    /// The Kubernetes API emulator.
    #[arg(long)]
    kube_url: String,
    /// The GameLift emulator (not used with `--aws-queue`).
    #[arg(long, default_value = "")]
    gamelift_url: String,
    /// The world's redis-server (not used with `--aws-queue`).
    #[arg(long, default_value = "")]
    redis_url: String,
    /// First agent index.
    #[arg(long)]
    from: usize,
    /// One past the last agent index.
    #[arg(long)]
    to: usize,
    /// Queue mode: the agents read EC2 events relayed onto their Node.
    #[arg(long)]
    aws_queue: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The agents' runtime: two workers, the machine's cores, as one process of agents
    // would use them.
    run_on_two_workers(
        "agents",
        run(ShardSpec {
            kube_url: args.kube_url,
            gamelift_url: args.gamelift_url,
            redis_url: args.redis_url,
            from: args.from,
            to: args.to,
            aws_queue: args.aws_queue,
        }),
    )?
}
