//! What one forward step computes: for each request, its new tokens at the end of its
//! context, and where that context lives in the paged KV pool.
use cubecl::prelude::*;
use cubecl::server::ServerError;
use kiln_core::sampling::SamplingRow;
use kiln_kernels::mla::{
    attends_per_head, tree_mask_words, AttnMetadata, ContextRows, PagedKvCache, MAX_TREE_NODES,
};
use kiln_kernels::{DeviceArray, PendingRead};

use super::ModelError;

/// Per-layer paged KV caches sharing one page table.
pub struct KvPool {
    pub caches: Vec<PagedKvCache>,
    pub page_size: usize,
    pub num_pages: usize,
}

/// One request's share of a step: `tokens` are appended at positions
/// `kv_len - tokens.len() .. kv_len`; `block_table` lists the pages holding positions
/// `0..kv_len` in order. One new token is a decode step, several a prefill chunk (or a
/// draft to verify).
///
/// With `tree`, the last `tree.len()` tokens are a draft tree's nodes (node 0 its root,
/// `tree[k]` node `k`'s parent, -1 for the root): node `k`'s row is written at position
/// `start + k` (`start = kv_len - tree.len()`), but it is rotated as the token at
/// `start + depth(k)` and sees only the positions before `start` and its ancestors. Only
/// the rows of the path from the root that stays `0, 1, 2, ..` are where the tokens
/// belong afterwards; the others are rewritten by a later step.
#[derive(Clone, Debug)]
pub struct RequestSlice {
    pub tokens: Vec<u32>,
    pub kv_len: usize,
    pub block_table: Vec<u32>,
    /// At most [`MAX_TREE_NODES`] nodes; `None`: causal.
    pub tree: Option<Vec<i32>>,
}

/// Which tokens of a step get logits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LogitRows {
    /// Every token (prefill checks, draft verification).
    #[default]
    All,
    /// Only each request's last token: what serving samples from. lm_head then reads one
    /// row per request instead of one per token (a 100k-token prefill chunk at Kimi's
    /// vocabulary would otherwise produce 65 GB of logits).
    Last,
    /// Each request's last `n` tokens, `n` per request in order: a decode step's one row,
    /// a drafted chain's `1 + draft` (each draft token is verified against its row).
    Tails(Vec<usize>),
}

/// The requests of one forward step, in the order their tokens are laid out.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub requests: Vec<RequestSlice>,
    /// Which tokens get logits.
    pub logits: LogitRows,
    /// Layers whose output hidden states (the residual stream after the layer, all tokens)
    /// the step also returns: what speculative drafters condition on.
    pub capture: Vec<usize>,
    /// Draw each logits row's token on the device, as its [`SamplingRow`] says (one per
    /// row), and return the tokens ([`StepOutput::tokens`]) instead of the rows: a token id
    /// a row read back instead of `vocab` floats.
    pub sampling: Option<Vec<SamplingRow>>,
    /// With `sampling`, also each row's token's log-probability and this many most likely
    /// alternatives ([`StepOutput::logprobs`]), computed on the device.
    pub logprobs: Option<usize>,
    /// `(token, row)`: the step's token `token` (counted over all requests' tokens in
    /// order; the host's id there is ignored) is the one the previous step sampled at
    /// `row`, read on the device ([`GpuModel::launch`](super::GpuModel::launch)).
    pub from_previous: Vec<(usize, usize)>,
    /// With `sampling`, `(row, allowed)`: the row's token is drawn with the tokens whose
    /// bit is clear in `allowed` (bit `t % 32` of word `t / 32`; words past the end allow
    /// nothing) at minus infinity, a grammar's mask; log-probabilities stay the raw row's.
    pub masks: Vec<(usize, Vec<u32>)>,
}

/// Log-probabilities of a step's rows (`kiln_kernels::sample::token_logprobs`).
#[derive(Clone, Debug, Default)]
pub struct RowLogprobs {
    /// Each row's token's log-probability.
    pub token: Vec<f32>,
    /// Alternatives a row lists.
    pub top: usize,
    /// `[rows, top]` ids (`kiln_kernels::sample::NO_TOKEN` past a row's numbers) and their
    /// log-probabilities.
    pub ids: Vec<u32>,
    pub values: Vec<f32>,
}

/// What a step returns.
#[derive(Clone, Debug)]
pub struct StepOutput {
    /// `[rows, vocab]` in request order: a row per token, or per request with
    /// [`LogitRows::Last`]; empty with [`Batch::sampling`].
    pub logits: Vec<f32>,
    /// With [`Batch::sampling`], each row's token.
    pub tokens: Vec<u32>,
    /// With [`Batch::logprobs`], their log-probabilities.
    pub logprobs: Option<RowLogprobs>,
    /// `(layer, [tokens, hidden])` for each layer in [`Batch::capture`], in that order.
    pub hidden: Vec<(usize, Vec<f32>)>,
    /// Kernel launches the step issued.
    pub launches: usize,
    /// Host time spent issuing the step, before waiting for its logits.
    pub issue_seconds: f64,
}

/// A step issued to the device ([`GpuModel::launch`](super::GpuModel::launch)) whose
/// outputs are still to be read.
pub struct Launched<'a> {
    pub(super) reads: Reads<'a>,
    pub(super) hidden: Vec<(usize, Vec<f32>)>,
    /// The rows that are the batch's and the logits' width (`None`: all rows are; a
    /// replayed step's padding rows follow the batch's).
    pub(super) rows: Option<(usize, usize)>,
    pub(super) launches: usize,
    pub(super) issue_seconds: f64,
}

/// What a step's kernels leave on the device, before any of it is read.
pub(super) struct Issued {
    /// `[rows, vocab]`.
    pub logits: DeviceArray<f32>,
    /// With sampling, each row's token, and with log-probabilities each row's token's,
    /// `top`, the alternatives' ids and theirs.
    pub sampled: Option<(DeviceArray<u32>, Option<LogprobArrays>)>,
    /// `(layer, [tokens, hidden])` for each captured layer.
    pub hidden: Vec<(usize, Vec<f32>)>,
}

pub(super) type LogprobArrays = (DeviceArray<f32>, usize, DeviceArray<u32>, DeviceArray<f32>);

impl Issued {
    /// Enqueues the reads of what the step returns, behind its kernels: waiting for them
    /// later does not wait for work issued after.
    pub fn reads<'a, R: Runtime>(&self, cl: &'a ComputeClient<R>) -> Reads<'a> {
        match &self.sampled {
            None => Reads::Logits(self.logits.read_later(cl)),
            Some((ids, logprobs)) => Reads::Tokens {
                tokens: ids.read_later(cl),
                logprobs: logprobs.as_ref().map(|(token, top, ids, values)| {
                    (
                        token.read_later(cl),
                        *top,
                        ids.read_later(cl),
                        values.read_later(cl),
                    )
                }),
                sampled: ids.clone(),
            },
        }
    }
}

/// The reads a launched step's outputs wait on.
pub(super) enum Reads<'a> {
    Logits(PendingRead<'a, f32>),
    Tokens {
        tokens: PendingRead<'a, u32>,
        /// Each row's token's, `top`, the alternatives' ids and theirs.
        logprobs: Option<LogprobReads<'a>>,
        /// The tokens on the device.
        sampled: DeviceArray<u32>,
    },
}

pub(super) type LogprobReads<'a> = (
    PendingRead<'a, f32>,
    usize,
    PendingRead<'a, u32>,
    PendingRead<'a, f32>,
);

impl Launched<'_> {
    /// The tokens this step samples on the device, if it does ([`Batch::sampling`]): what
    /// the next step's [`Batch::from_previous`] reads.
    pub fn sampled(&self) -> Option<&DeviceArray<u32>> {
        match &self.reads {
            Reads::Tokens { sampled, .. } => Some(sampled),
            Reads::Logits(_) => None,
        }
    }

    /// Waits for the step and returns its outputs.
    pub fn wait(self) -> Result<StepOutput, ModelError> {
        let device = |e: ServerError| ModelError::Device(e.to_string());
        let (mut logits, mut tokens, logprobs) = match self.reads {
            Reads::Logits(l) => (l.wait().map_err(device)?, Vec::new(), None),
            Reads::Tokens {
                tokens, logprobs, ..
            } => {
                let logprobs = match logprobs {
                    Some((token, top, ids, values)) => Some(RowLogprobs {
                        token: token.wait().map_err(device)?,
                        top,
                        ids: ids.wait().map_err(device)?,
                        values: values.wait().map_err(device)?,
                    }),
                    None => None,
                };
                (Vec::new(), tokens.wait().map_err(device)?, logprobs)
            }
        };
        if let Some((rows, vocab)) = self.rows {
            // Replayed at a padded size: the batch's rows come first. (Replays return no
            // log-probabilities.)
            logits.truncate(rows * vocab);
            tokens.truncate(rows);
        }
        Ok(StepOutput {
            logits,
            tokens,
            logprobs,
            hidden: self.hidden,
            launches: self.launches,
            issue_seconds: self.issue_seconds,
        })
    }
}

/// A batch's tokens as a step lays them out, checked against the vocabulary and the pool.
pub(super) struct Layout {
    pub tokens: Vec<u32>,
    /// Each token's rotary position (a draft tree node's: its depth past the context).
    pub positions: Vec<u32>,
    /// Cache row of each token.
    pub slots: Vec<u32>,
    /// `requests + 1` prefix sums of the requests' token counts.
    pub cu: Vec<u32>,
    /// The longest block table (at least 1).
    pub max_blocks: usize,
}

/// The layout of a batch, checked, uploaded once per step.
pub(super) struct Plan {
    pub num_tokens: usize,
    pub tokens: DeviceArray<u32>,
    pub positions: DeviceArray<u32>,
    /// Cache row of each new token.
    pub slots: DeviceArray<u32>,
    pub meta: AttnMetadata,
    /// Index of each request's last token, when only those get logits.
    pub last_rows: Option<DeviceArray<u32>>,
    /// Where some requests attend in MLA's per-head form (`None`: all absorbed).
    pub per_head: Option<PerHeadSplit>,
}

/// A batch's requests split between MLA's per-head form (long prefill spans) and the
/// absorbed one (the rest).
pub(super) struct PerHeadSplit {
    pub heads: Part,
    /// The per-head requests' context rows.
    pub context: ContextRows,
    /// The other requests (`None`: there are none).
    pub absorbed: Option<Part>,
}

/// Some of a batch's requests, as one attention call sees them.
pub(super) struct Part {
    pub meta: AttnMetadata,
    /// Their tokens' indices in the batch (`None`: every token of the batch, in order).
    pub rows: Option<DeviceArray<u32>>,
    pub positions: DeviceArray<u32>,
}

impl Batch {
    /// A step over `requests` that captures no hidden states.
    pub fn new(requests: Vec<RequestSlice>) -> Self {
        Batch {
            requests,
            logits: LogitRows::All,
            capture: Vec::new(),
            sampling: None,
            logprobs: None,
            from_previous: Vec::new(),
            masks: Vec::new(),
        }
    }

    /// A step over `requests` that returns logits of each request's last token only.
    pub fn last_logits(requests: Vec<RequestSlice>) -> Self {
        Batch {
            logits: LogitRows::Last,
            ..Batch::new(requests)
        }
    }

    /// Checks the batch against the vocabulary and the pool, and lays it out; requests of
    /// `per_head.0` new tokens or more attend in the per-head form ([`attends_per_head`]),
    /// their contexts expanded in chunks of at most about `per_head.1` rows.
    pub(super) fn plan<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        vocab: usize,
        pool: &KvPool,
        per_head: Option<(usize, usize)>,
    ) -> Result<Plan, ModelError> {
        let Layout {
            tokens,
            positions,
            slots,
            cu,
            max_blocks,
        } = self.layout(vocab, pool)?;
        let all: Vec<usize> = (0..self.requests.len()).collect();
        let meta = attention_meta(client, &self.requests, &all, max_blocks);
        let (heads, rest): (Vec<usize>, Vec<usize>) = all.iter().partition(|&&b| {
            let r = &self.requests[b];
            attends_per_head(r.tokens.len(), r.tree.is_some(), per_head.map(|p| p.0))
        });
        let part = |members: &[usize]| {
            let rows: Vec<u32> = members.iter().flat_map(|&b| cu[b]..cu[b + 1]).collect();
            let pos: Vec<u32> = rows.iter().map(|&t| positions[t as usize]).collect();
            Part {
                meta: attention_meta(client, &self.requests, members, max_blocks),
                rows: (rows.len() < tokens.len()).then(|| DeviceArray::upload(client, &rows)),
                positions: DeviceArray::upload(client, &pos),
            }
        };
        let per_head = per_head.filter(|_| !heads.is_empty()).map(|(_, most)| {
            let kv_lens: Vec<usize> = heads.iter().map(|&b| self.requests[b].kv_len).collect();
            PerHeadSplit {
                heads: part(&heads),
                context: ContextRows::new(client, &kv_lens, most),
                absorbed: (!rest.is_empty()).then(|| part(&rest)),
            }
        });
        let rows: Option<Vec<u32>> = match &self.logits {
            LogitRows::All => None,
            LogitRows::Last => Some(cu[1..].iter().map(|&end| end - 1).collect()),
            LogitRows::Tails(tails) => {
                if tails.len() != self.requests.len()
                    || tails
                        .iter()
                        .zip(&self.requests)
                        .any(|(&n, r)| n == 0 || n > r.tokens.len())
                {
                    return Err(ModelError::Batch(format!(
                        "logit tails {tails:?} do not fit the requests' tokens"
                    )));
                }
                Some(
                    (cu[1..].iter().zip(tails))
                        .flat_map(|(&end, &n)| end - n as u32..end)
                        .collect(),
                )
            }
        };
        let last_rows = rows.map(|rows| DeviceArray::upload(client, &rows));
        Ok(Plan {
            last_rows,
            num_tokens: tokens.len(),
            tokens: DeviceArray::upload(client, &tokens),
            positions: DeviceArray::upload(client, &positions),
            slots: DeviceArray::upload(client, &slots),
            meta,
            per_head,
        })
    }

    /// Checks the batch against the vocabulary and the pool, and lays its tokens out.
    pub(super) fn layout(&self, vocab: usize, pool: &KvPool) -> Result<Layout, ModelError> {
        let bad = |msg: String| Err(ModelError::Batch(msg));
        if self.requests.is_empty() {
            return bad("no requests".into());
        }
        if let Some(&l) = self.capture.iter().find(|&&l| l >= pool.caches.len()) {
            return bad(format!("cannot capture layer {l} of {}", pool.caches.len()));
        }
        let max_blocks = self
            .requests
            .iter()
            .map(|r| r.block_table.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let (mut tokens, mut positions, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        let mut cu = vec![0u32];
        for (b, r) in self.requests.iter().enumerate() {
            let q = r.tokens.len();
            if q == 0 || q > r.kv_len {
                return bad(format!(
                    "request {b}: {q} new tokens for a context of {}",
                    r.kv_len
                ));
            }
            if r.block_table.len() * pool.page_size < r.kv_len {
                return bad(format!(
                    "request {b}: {} pages cannot hold {} tokens",
                    r.block_table.len(),
                    r.kv_len
                ));
            }
            if let Some(&p) = r
                .block_table
                .iter()
                .find(|&&p| p as usize >= pool.num_pages)
            {
                return bad(format!(
                    "request {b}: page {p} is outside the pool of {}",
                    pool.num_pages
                ));
            }
            if let Some(&t) = r.tokens.iter().find(|&&t| t as usize >= vocab) {
                return bad(format!(
                    "request {b}: token id {t} is outside the vocabulary of {vocab}"
                ));
            }
            let tree = r.tree.as_deref().unwrap_or(&[-1]);
            let depths = tree_depths(tree)
                .map_err(|e| ModelError::Batch(format!("request {b}: draft tree {tree:?}: {e}")))?;
            if tree.len() > q.min(MAX_TREE_NODES) {
                return bad(format!(
                    "request {b}: a draft tree of {} nodes over {q} new tokens (at most {MAX_TREE_NODES})",
                    tree.len()
                ));
            }
            let start = r.kv_len - tree.len();
            for (i, &t) in r.tokens.iter().enumerate() {
                let pos = r.kv_len - q + i;
                tokens.push(t);
                let rotated = match pos.checked_sub(start) {
                    Some(node) => start + depths[node],
                    None => pos,
                };
                positions.push(rotated as u32);
                let page = r.block_table[pos / pool.page_size] as usize;
                slots.push((page * pool.page_size + pos % pool.page_size) as u32);
            }
            cu.push(tokens.len() as u32);
        }
        Ok(Layout {
            tokens,
            positions,
            slots,
            cu,
            max_blocks,
        })
    }
}

/// The attention metadata of requests `members` (indices into `requests`, in order) laid
/// out one after another.
fn attention_meta<R: Runtime>(
    client: &ComputeClient<R>,
    requests: &[RequestSlice],
    members: &[usize],
    max_blocks: usize,
) -> AttnMetadata {
    let any_tree = members.iter().any(|&b| requests[b].tree.is_some());
    let (mut cu, mut kv_lens, mut masks) = (vec![0u32], Vec::new(), Vec::new());
    let mut table = vec![0u32; members.len() * max_blocks];
    for (i, &b) in members.iter().enumerate() {
        let r = &requests[b];
        cu.push(cu[i] + r.tokens.len() as u32);
        kv_lens.push(r.kv_len as u32);
        table[i * max_blocks..i * max_blocks + r.block_table.len()].copy_from_slice(&r.block_table);
        if any_tree {
            masks.extend(tree_mask_words(
                r.tokens.len(),
                r.tree.as_deref().unwrap_or(&[-1]),
            ));
        }
    }
    let of = |f: fn(&RequestSlice) -> usize| members.iter().map(|&b| f(&requests[b])).max();
    AttnMetadata {
        batch: members.len(),
        num_tokens: cu[members.len()] as usize,
        max_q_len: of(|r| r.tokens.len()).unwrap_or(1),
        max_kv_len: of(|r| r.kv_len).unwrap_or(1),
        cu_q_lens: DeviceArray::upload(client, &cu),
        kv_lens: DeviceArray::upload(client, &kv_lens),
        block_table: DeviceArray::upload(client, &table),
        max_blocks,
        tree_masks: any_tree.then(|| DeviceArray::upload(client, &masks)),
    }
}

/// Each node's depth (the root's 0), or why `parents` is not a tree in index order.
fn tree_depths(parents: &[i32]) -> Result<Vec<usize>, String> {
    let mut depths: Vec<usize> = Vec::with_capacity(parents.len());
    for (k, &p) in parents.iter().enumerate() {
        match (k, p) {
            (0, -1) => depths.push(0),
            (0, _) => return Err(format!("the root has parent {p}")),
            (_, p) if p >= 0 && (p as usize) < k => depths.push(depths[p as usize] + 1),
            _ => return Err(format!("node {k} has parent {p}, not an earlier node")),
        }
    }
    if depths.is_empty() {
        return Err("no nodes".into());
    }
    Ok(depths)
}
