//! Placement policies by name and the kiln policy's tunables.
//!
//! - `random`: every request to a uniformly random healthy replica (the stateless
//!   baseline; no affinity).
//! - `session-hash`: rendezvous hashing of the session key over the healthy replicas
//!   (Modal's original "session affinity" routing; Poisson-dispersed load).
//! - `kiln` (default): session affinity; new sessions on the least-loaded replica by
//!   active sessions, in-flight requests and KV usage; thick sessions split past a
//!   threshold of in-flight requests; new replicas fill with new sessions first and
//!   existing sessions move only past an imbalance threshold, as few as possible.

use serde::Serialize;

/// A placement policy, selectable by name on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// Each request to a uniformly random healthy replica.
    Random,
    /// Rendezvous hashing of the session key.
    SessionHash,
    /// Affinity plus load-aware placement, thick-session splitting and gentle rebalancing.
    Kiln,
}

impl PolicyName {
    /// Every policy, baselines first (the simulator's row order).
    pub const ALL: [PolicyName; 3] = [
        PolicyName::Random,
        PolicyName::SessionHash,
        PolicyName::Kiln,
    ];

    /// The name as typed on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Random => "random",
            PolicyName::SessionHash => "session-hash",
            PolicyName::Kiln => "kiln",
        }
    }
}

impl std::fmt::Display for PolicyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Tunables of the `kiln` policy (defaults are the ones the simulator validates).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KilnParams {
    /// In-flight requests of one session on one replica past which its next concurrent
    /// request goes to another replica.
    pub split_threshold: u32,
    /// Active sessions by which the busiest replica may exceed the least busy settled
    /// replica before idle sessions are moved.
    pub imbalance_threshold: u32,
    /// Load score of a full KV cache, in sessions.
    pub kv_weight: f64,
    /// A session counts towards its replica's load while it sent a request this recently.
    pub active_window_ms: u64,
    /// A session idle this long is forgotten (its affinity is lost).
    pub forget_after_ms: u64,
    /// A replica this young is not yet a rebalancing trigger: it fills with new sessions.
    pub new_replica_grace_ms: u64,
}

impl Default for KilnParams {
    fn default() -> Self {
        Self {
            split_threshold: 3,
            imbalance_threshold: 4,
            kv_weight: 2.0,
            active_window_ms: 120_000,
            forget_after_ms: 3_600_000,
            new_replica_grace_ms: 120_000,
        }
    }
}
