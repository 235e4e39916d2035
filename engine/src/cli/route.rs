//! `kiln route`: the router and its simulator, implemented in the `kiln-router` crate
//! (which does not depend on the engine, so it also builds and runs on its own).
pub use kiln_router::cli::RouteArgs;

/// Serves the router, or runs the simulator with `--simulate`.
pub fn run(args: RouteArgs) -> anyhow::Result<()> {
    kiln_router::cli::run(args)?;
    Ok(())
}
