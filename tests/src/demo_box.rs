//! `lastcall-demo --box`: the demo's FleetIQ drain on the box instead of the emulated
//! cluster: a real kube-apiserver, etcd, controller manager, scheduler and kwok (see
//! [`crate::kube_box`]), the GameLift emulator, a private redis-server, the real pubsub and
//! the real agent process started as the chart runs it, with its ServiceAccount's token.
//! There is no Agones on the box (its stand-in plays the GameServers, without Fleets), so
//! no replacement is created elsewhere; the rest of the story is the demo's.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

use crate::eventually::try_eventually;
use crate::gamelift::InstanceStatus;
use crate::kube_box::agent::AgentProcess;
use crate::kube_box::agones::{self, Agones, Allocation, Crd, Server};
use crate::kube_box::fleetiq::FleetIq;
use crate::kube_box::{self, KubeBox};

const NS: &str = "demo";
const NODE: &str = "box-node-a";

/// Runs the story, each step bounded by `step_within`.
pub async fn run(step_within: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    say("starting the box: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok");
    let kbox = KubeBox::start().await.context("starting the box")?;
    say(&format!("box up in {:.1?}", kbox.started_in()));
    let client = kbox.client().await?;
    agones::install_crd(&client, Crd::SelectableNodeName).await?;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    wait(
        step_within,
        "the namespace's default ServiceAccount",
        || async { sas.get_opt("default").await.ok().flatten().map(|_| ()) },
    )
    .await?;
    agones::ensure_pdb(&client, NS).await?;
    kube_box::create_node(&client, NODE).await?;
    let game = Agones::new(&client, NS);
    let mut servers = vec![];
    for i in 0..5 {
        servers.push(game.ready_server(&format!("gs-{i}"), NODE).await?);
    }
    let (idle, busy) = servers.split_at(3);
    for s in busy {
        if !matches!(game.allocate(&s.name).await?, Allocation::Allocated(_)) {
            bail!("allocating {} failed", s.name);
        }
    }
    say(&format!(
        "{NODE} (a kwok node) runs 5 GameServers: {} Ready, {} Allocated (matches running)",
        idle.len(),
        busy.len()
    ));

    let mut fiq = FleetIq::start(NODE)
        .await
        .context("the GameLift emulator, redis-server and lastcall-pubsub")?;
    let agent = AgentProcess::start(&kbox, NODE, fiq.agent_extra())
        .await
        .context("lastcall-agent")?;
    agent.ready().await?;
    say("lastcall-agent is running with the chart's arguments and RBAC (a TokenRequest token)");
    wait(step_within, "the agent registers with FleetIQ", || async {
        (fiq.gl.count("RegisterGameServer") == 1).then_some(())
    })
    .await?;

    say("GameLift marks the instance DRAINING; pubsub publishes it on Redis");
    fiq.set(InstanceStatus::Draining);
    let nodes: Api<Node> = Api::all(client.clone());
    wait(step_within, "the node fenced", || async {
        let n = nodes.get(NODE).await.ok()?;
        let spec = n.spec?;
        let tainted = spec
            .taints
            .unwrap_or_default()
            .iter()
            .any(|t| t.key == "lastcall.dev/draining");
        (spec.unschedulable == Some(true) && tainted).then_some(())
    })
    .await?;
    say(&format!(
        "{NODE} fenced: cordoned and tainted lastcall.dev/draining"
    ));
    for s in idle {
        wait(step_within, &format!("{} released", s.name), || async {
            game.get(&s.name).await.ok()?.is_none().then_some(())
        })
        .await?;
        say(&format!("released {} (it was idle)", s.name));
    }
    for s in busy {
        wait(step_within, &format!("{} protected", s.name), || async {
            protected(&game, s).await.then_some(())
        })
        .await?;
        say(&format!("protected {} (its match goes on)", s.name));
    }
    if fiq.gl.count("DeregisterGameServer") != 0 {
        bail!("deregistered while matches ran");
    }
    say("the matches end");
    for s in busy {
        game.shutdown(s).await?;
    }
    wait(step_within, "the node deregistered", || async {
        (fiq.gl.count("DeregisterGameServer") == 1).then_some(())
    })
    .await?;
    say(&format!(
        "lastcall called DeregisterGameServer once; {NODE} is deregistered"
    ));
    if !fiq.pubsub_running() {
        bail!("lastcall-pubsub exited");
    }
    agent.stop().await?;
    say(&format!(
        "Demo on the box complete in {:.1?}",
        started.elapsed()
    ));
    Ok(())
}

async fn protected(game: &Agones, s: &Server) -> bool {
    game.get(&s.name).await.ok().flatten().is_some_and(|gs| {
        gs.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("lastcall.dev/drain-deadline")
    })
}

async fn wait<T, F, Fut>(within: Duration, what: &str, cond: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    try_eventually(what, within, Duration::from_millis(50), cond)
        .await
        .map_err(|e| anyhow::anyhow!("{} not reached within {:?}", e.what, e.within))
}

fn say(line: &str) {
    println!("[box] {line}");
}
