//! `kiln route`: its arguments and entry point (serve, or simulate with `--simulate`).

use axum::serve::ListenerExt;

use crate::error::RouterError;
use crate::placer::Placer;
use crate::policy::{KilnParams, PolicyName};
use crate::proxy::{app, AppState};
use crate::replicas::ReplicaSource;
use crate::sim::{report, simulate, SimConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Arguments of `kiln route`.
#[derive(Debug, Clone, clap::Args)]
pub struct RouteArgs {
    /// A replica's base URL, e.g. http://127.0.0.1:30000 (repeatable).
    #[arg(long = "replica", value_name = "URL")]
    pub replicas: Vec<String>,
    /// A file of replica URLs, one a line (# comments); re-read on SIGHUP and on change.
    #[arg(long, value_name = "FILE")]
    pub replicas_file: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: a free port; the chosen address is printed on stdout).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Placement policy.
    #[arg(long, value_enum, default_value_t = PolicyName::Kiln)]
    pub policy: PolicyName,
    /// kiln policy: a session's in-flight requests on one replica past which the next
    /// concurrent one goes elsewhere.
    #[arg(long, default_value_t = KilnParams::default().split_threshold)]
    pub split_threshold: u32,
    /// kiln policy: active sessions by which the busiest replica may exceed the least
    /// busy before idle sessions move.
    #[arg(long, default_value_t = KilnParams::default().imbalance_threshold)]
    pub imbalance_threshold: u32,
    /// Milliseconds between scrapes of the replicas' /metrics (health and load).
    #[arg(long, default_value_t = 500)]
    pub scrape_interval_ms: u64,
    /// Run the deterministic simulator (every policy) instead of serving.
    #[arg(long)]
    pub simulate: bool,
    /// Simulator: replicas.
    #[arg(long, default_value_t = 50)]
    pub sim_replicas: usize,
    /// Simulator: sessions per replica.
    #[arg(long, default_value_t = 5)]
    pub sessions_per_replica: usize,
    /// Simulator: most concurrent requests a tree-shaped session's turn sends (the
    /// benchmark's default is 4; larger values stress thick-session splitting).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..))]
    pub fanout_max: u32,
    /// Simulator: seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Simulator: also write the per-policy results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl RouteArgs {
    fn kiln_params(&self) -> KilnParams {
        KilnParams {
            split_threshold: self.split_threshold,
            imbalance_threshold: self.imbalance_threshold,
            ..KilnParams::default()
        }
    }
}

/// Runs `kiln route` with `args`.
pub fn run(args: RouteArgs) -> Result<(), RouterError> {
    if args.simulate {
        return run_simulation(&args);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| RouterError::Io {
            context: "cannot start the async runtime".into(),
            source,
        })?;
    runtime.block_on(serve(args))
}

fn run_simulation(args: &RouteArgs) -> Result<(), RouterError> {
    let mut config = SimConfig::scenario(args.sim_replicas, args.sessions_per_replica, args.seed);
    config.kiln = args.kiln_params();
    config.workload.fanout_max = args.fanout_max;
    let reports = simulate(&config)?;
    println!(
        "kiln route --simulate: {} replicas x {} sessions, seed {}, fan-out up to {}",
        args.sim_replicas, args.sessions_per_replica, args.seed, args.fanout_max
    );
    print!("{}", report::render(&reports));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&reports).expect("reports serialise");
        std::fs::write(path, text + "\n").map_err(|source| RouterError::Io {
            context: format!("cannot write {}", path.display()),
            source,
        })?;
    }
    Ok(())
}

/// Serves the router until the process is stopped.
pub async fn serve(args: RouteArgs) -> Result<(), RouterError> {
    let source = ReplicaSource {
        urls: args.replicas.clone(),
        file: args.replicas_file.clone(),
    };
    if source.urls.is_empty() && source.file.is_none() {
        return Err(RouterError::NoReplicas);
    }
    let placer = Placer::new(args.policy, args.kiln_params(), args.seed);
    let state = Arc::new(AppState::new(placer, source)?);
    let address = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|source| RouterError::Bind {
            address: address.clone(),
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| RouterError::Bind { address, source })?;
    let interval = Duration::from_millis(args.scrape_interval_ms.max(10));
    tokio::spawn(crate::health::upkeep(state.clone(), interval));
    #[cfg(unix)]
    tokio::spawn(crate::health::reload_on_sighup(state.clone()));
    tracing::info!(policy = %args.policy, replicas = state.placer().replicas().len(), "routing");
    println!("kiln route listening on http://{local}");
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle's algorithm and the
    // client's delayed ACK hold each back ~40 ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY not set: {e}");
        }
    });
    axum::serve(listener, app(state))
        .await
        .map_err(|source| RouterError::Io {
            context: "serving".into(),
            source,
        })
}
