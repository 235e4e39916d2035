#!/usr/bin/env python3
"""Golden logits from HuggingFace transformers' DeepseekV3ForCausalLM for kiln.

For each tiny config below this script builds `DeepseekV3ForCausalLM(DeepseekV3Config(...))`
in float32, fills it with seeded random weights whose every value is bf16-representable,
runs it (eval mode, eager attention, eager experts) on seeded token sequences and writes
`<out>/<name>/`:

- `config.json`: the HF config as `save_pretrained` writes it (`dtype` set to bfloat16,
  the dtype of the stored weights; the NVFP4 fixture adds a ModelOpt
  `quantization_config`);
- `model.safetensors`: the weights under HF checkpoint names, bf16 (the router's
  `e_score_correction_bias` in f32, as in the real checkpoints, with bf16 values);
  routed experts per expert (`model.layers.{i}.mlp.experts.{j}.gate_proj.weight`, ...),
  as real checkpoints store them. For `tiny-kimi-nvfp4` the routed experts are ModelOpt
  NVFP4: `weight` u8 `[out, in/2]` (low nibble = even element), `weight_scale` e4m3
  `[out, in/16]`, `weight_scale_2` f32 scalar, `input_scale` f32 scalar (1.0);
- `golden.safetensors`: `tokens_{s}` (int64 `[len]`) and `logits_{s}` (f32 `[len, vocab]`)
  for each sequence `s`, each run alone at positions `0..len`.

The logits are what HF computes in float32 from exactly the stored values (bf16 upcast,
or NVFP4 dequantized as `e2m1 * weight_scale * weight_scale_2` in f32). The NVFP4
quantizer reproduces kiln's `reference/src/nvfp4.rs` bit for bit: global scale
`amax / (6 * 448)` (gate and up of one expert share it: their amax is taken together),
block scale `e4m3(clamp(block_amax / 6 / global, 2^-9, 448))`, code
`e2m1(x / (scale * global))`, all in f32, round to nearest, ties to even.

Weight scales: linear layers ~ N(0, 1/fan_in) so activations stay O(1); norms
`1 + 0.1 N(0, 1)`; router biases `0.05 N(0, 1)` (they change about a third of the
selections); tied embeddings ~ N(0, 2.25/hidden). Logits come out O(1) (std 1-1.5).
Tokens are random, each redrawn until every routing decision at its position is at
least `ROUTING_MARGIN` (4e-3 in sigmoid-score units) away from a tie, so engines
computing in bf16 route the golden sequences exactly as HF does.

Run: `python3 tools/hf_golden.py --out tests/fixtures/hf [--device cpu|cuda]`.
`--checkpoint DIR --out tests/fixtures/hf/kiln-coder` instead writes only
`golden.safetensors` for a trained model directory (kiln's embedded kiln-coder): HF's
logits on a chat prompt and a code prompt, each cut before the first position whose
routing is within CHECKPOINT_MARGIN of a tie. With
`--check` it reloads each bf16 fixture through `from_pretrained` and checks the logits
are reproduced (the files are what HF reads). `--dump-raw DIR` also writes every
weight (dequantized) and golden as raw little-endian f32 plus a manifest, for
debugging without a safetensors reader.

Generated with: Python 3.11.7, torch 2.15.0 (CPU), transformers 5.24.0,
safetensors 0.8.0, numpy 2.4.6. transformers 5.17.0's DeepseekV3 modeling code is the
same for everything used here (checked by diff).
"""

import argparse
import json
import os

# cuBLAS needs this for deterministic algorithms; set before torch initialises CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

SEQ_LENS = (1, 7, 33)
# Smallest distance from a tie (in sigmoid-score units) of any routing decision on the
# golden tokens: far above the error of an engine computing in bf16.
ROUTING_MARGIN = 4e-3

KIMI_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Kimi's MLA dims with small everything else. 2 heads (not 4) keep kv_b_proj, which is
# heads * 256 * 512 per layer, inside the fixtures' size budget.
TINY_KIMI = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=192,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=96,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    max_position_embeddings=128,
    rope_parameters=KIMI_ROPE,
    rope_interleave=True,
    tie_word_embeddings=False,
)

# The q_proj path, grouped routing, plain RoPE, tied embeddings, odd sizes.
TINY_DSV3 = dict(
    vocab_size=389,
    hidden_size=120,
    intermediate_size=152,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=5,
    num_key_value_heads=5,
    q_lora_rank=None,
    kv_lora_rank=72,
    qk_nope_head_dim=24,
    qk_rope_head_dim=16,
    v_head_dim=40,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rope_interleave=True,
    tie_word_embeddings=True,
)

FIXTURES = {
    "tiny-kimi": (TINY_KIMI, 20240501, False),
    "tiny-dsv3": (TINY_DSV3, 20240502, False),
    "tiny-kimi-nvfp4": (TINY_KIMI, 20240501, True),
}

MODELOPT_QUANT = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "kv_cache_quant_algo": None,
    "exclude_modules": [
        "lm_head",
        "model.layers.*.self_attn*",
        "model.layers.0.mlp*",
        "model.layers.*.mlp.shared_experts*",
        "model.layers.*.mlp.gate",
    ],
}


def make_config(fields):
    return DeepseekV3Config(
        **fields,
        rms_norm_eps=1e-6,
        attention_bias=False,
        hidden_act="silu",
        attn_implementation="eager",
        experts_implementation="eager",
    )


def bf16(t):
    return t.to(torch.bfloat16).to(torch.float32)


def weight_shapes(c):
    """Every tensor of the checkpoint, HF name -> (shape, kind), in a fixed order."""
    h, nh = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    shapes = {"model.embed_tokens.weight": ((c.vocab_size, h), "embed")}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = ((h,), "norm")
        shapes[p + "post_attention_layernorm.weight"] = ((h,), "norm")
        if c.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = ((nh * qk, h), "linear")
        else:
            shapes[a + "q_a_proj.weight"] = ((c.q_lora_rank, h), "linear")
            shapes[a + "q_a_layernorm.weight"] = ((c.q_lora_rank,), "norm")
            shapes[a + "q_b_proj.weight"] = ((nh * qk, c.q_lora_rank), "linear")
        shapes[a + "kv_a_proj_with_mqa.weight"] = ((c.kv_lora_rank + c.qk_rope_head_dim, h), "linear")
        shapes[a + "kv_a_layernorm.weight"] = ((c.kv_lora_rank,), "norm")
        kv_b_rows = nh * (c.qk_nope_head_dim + c.v_head_dim)
        shapes[a + "kv_b_proj.weight"] = ((kv_b_rows, c.kv_lora_rank), "linear")
        shapes[a + "o_proj.weight"] = ((h, nh * c.v_head_dim), "linear")
        if i < c.first_k_dense_replace:
            mlps = [(p + "mlp.", c.intermediate_size)]
        else:
            shapes[p + "mlp.gate.weight"] = ((c.n_routed_experts, h), "linear")
            shapes[p + "mlp.gate.e_score_correction_bias"] = ((c.n_routed_experts,), "bias")
            mlps = [(p + f"mlp.experts.{j}.", c.moe_intermediate_size) for j in range(c.n_routed_experts)]
            mlps.append((p + "mlp.shared_experts.", c.moe_intermediate_size * c.n_shared_experts))
        for prefix, inter in mlps:
            shapes[prefix + "gate_proj.weight"] = ((inter, h), "linear")
            shapes[prefix + "up_proj.weight"] = ((inter, h), "linear")
            shapes[prefix + "down_proj.weight"] = ((h, inter), "linear")
    shapes["model.norm.weight"] = ((h,), "norm")
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = ((c.vocab_size, h), "linear")
    return shapes


def random_weights(c, seed):
    """Seeded, bf16-representable f32 weights under checkpoint names."""
    gen = torch.Generator().manual_seed(seed)
    # Tied embeddings double as lm_head: keep them small so logits stay O(1).
    embed_std = c.hidden_size**-0.5 * 1.5 if c.tie_word_embeddings else 1.0
    out = {}
    for name, (shape, kind) in weight_shapes(c).items():
        z = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "embed":
            w = z * embed_std
        elif kind == "norm":
            w = 1.0 + 0.1 * z
        elif kind == "bias":
            w = 0.05 * z
        else:
            w = z * shape[1] ** -0.5
        out[name] = bf16(w)
    return out


# ---- NVFP4 (ModelOpt), bit-exact with reference/src/nvfp4.rs ----

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between neighbouring E2M1 magnitudes; a tie goes to the even code, which
# is the upper neighbour after odd codes (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0).
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


def e2m1_encode(x):
    mag = x.abs().unsqueeze(-1)
    above = (mag > E2M1_MIDPOINTS) | ((mag == E2M1_MIDPOINTS) & E2M1_TIE_UP)
    code = above.sum(-1).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(code):
    mag = E2M1_VALUES[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def nvfp4_quantize(w):
    """`w` f32 [rows, cols] -> (packed u8, scales e4m3, global f32 scalar, dequantized)."""
    rows, cols = w.shape
    assert cols % 16 == 0, cols
    amax = w.abs().max()
    glob = amax / torch.tensor(6.0 * 448.0)
    glob = torch.where(glob == 0, torch.tensor(1.0), glob).to(torch.float32)
    blocks = w.reshape(rows, cols // 16, 16)
    block_amax = blocks.abs().amax(-1)
    target = (block_amax / 6.0 / glob).clamp(2.0**-9, 448.0)
    scale = target.to(torch.float8_e4m3fn)
    divisor = scale.to(torch.float32) * glob
    codes = e2m1_encode(blocks / divisor.unsqueeze(-1)).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    deq = (e2m1_decode(codes).reshape(rows, cols // 16, 16) * scale.to(torch.float32).unsqueeze(-1)) * glob
    return packed.contiguous(), scale.contiguous(), glob.reshape(()), deq.reshape(rows, cols)


def quantize_experts(c, weights):
    """Replaces routed-expert weights by NVFP4; returns (dequantized f32, stored tensors)."""
    deq = dict(weights)
    stored = dict(weights)
    for i in range(c.first_k_dense_replace, c.num_hidden_layers):
        for j in range(c.n_routed_experts):
            p = f"model.layers.{i}.mlp.experts.{j}."
            gate, up, down = (weights[p + f"{m}_proj.weight"] for m in ("gate", "up", "down"))
            inter = gate.shape[0]
            # Gate and up share one weight_scale_2: quantize them as one [2I, H] matrix
            # (block scales are per row, so only the global scale is shared).
            gu = nvfp4_quantize(torch.cat([gate, up]))
            parts = {
                "gate": tuple(t[:inter] if t.dim() else t for t in gu),
                "up": tuple(t[inter:] if t.dim() else t for t in gu),
                "down": nvfp4_quantize(down),
            }
            for m, (packed, scale, glob, dq) in parts.items():
                n = p + f"{m}_proj."
                del stored[n + "weight"]
                stored[n + "weight"] = packed
                stored[n + "weight_scale"] = scale
                stored[n + "weight_scale_2"] = glob.clone()
                stored[n + "input_scale"] = torch.tensor(1.0)
                deq[n + "weight"] = dq
    return deq, stored


# ---- HF model ----


def hf_state_dict(c, weights):
    """Checkpoint names -> the module's state dict (experts fused as gate_up_proj)."""
    sd = {}
    for name, w in weights.items():
        if ".mlp.experts." not in name:
            sd[name] = w
    if c.tie_word_embeddings:
        sd["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for i in range(c.first_k_dense_replace, c.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        ex = range(c.n_routed_experts)
        sd[p + "gate_up_proj"] = torch.stack(
            [torch.cat([weights[p + f"{j}.gate_proj.weight"], weights[p + f"{j}.up_proj.weight"]]) for j in ex]
        )
        sd[p + "down_proj"] = torch.stack([weights[p + f"{j}.down_proj.weight"] for j in ex])
    return sd


def build_model(c, weights, device):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(c).to(torch.float32)
    missing, unexpected = model.load_state_dict(hf_state_dict(c, weights), strict=False)
    # inv_freq buffers are not persistent; lm_head is tied when tie_word_embeddings.
    assert not unexpected, unexpected
    assert all("lm_head" in k for k in missing), missing
    if c.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval().to(device)


@torch.no_grad()
def logits_of(model, tokens, device):
    out = model(input_ids=tokens.unsqueeze(0).to(device), use_cache=False)
    return out.logits[0].to("cpu", torch.float32).contiguous()


def router_outputs(model, c, tokens, device):
    """[(router module, router logits [len, E], selected experts [len, k])] per MoE layer."""
    caught = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: caught.append((m, o[0], o[2])))
        for layer in model.model.layers[c.first_k_dense_replace :]
    ]
    with torch.no_grad():
        model(input_ids=tokens.unsqueeze(0).to(device), use_cache=False)
    for h in hooks:
        h.remove()
    return caught


def routing_margins(model, c, tokens, device):
    """Per token, the smallest distance of a routing decision from a tie over all MoE
    layers: last kept vs first dropped group score, k-th vs (k+1)-th choice among the
    kept groups' experts (HF's f32 values)."""
    k, g, tg = c.num_experts_per_tok, c.n_group, c.topk_group
    margin = torch.full((len(tokens),), float("inf"))
    for gate, logits, _ in router_outputs(model, c, tokens, device):
        choice = (logits.sigmoid() + gate.e_score_correction_bias).cpu()
        group_scores = choice.view(len(tokens), g, -1).topk(2, dim=-1)[0].sum(-1)
        if tg < g:
            ranked = group_scores.sort(-1, descending=True)[0]
            margin = torch.minimum(margin, ranked[:, tg - 1] - ranked[:, tg])
        kept = torch.zeros_like(group_scores).scatter(1, group_scores.topk(tg, dim=-1)[1], 1.0)
        kept = kept.repeat_interleave(c.n_routed_experts // g, dim=1).bool()
        ranked = choice.masked_fill(~kept, float("-inf")).sort(-1, descending=True)[0]
        if kept.sum(-1).min() > k:
            margin = torch.minimum(margin, ranked[:, k - 1] - ranked[:, k])
    return margin


def pick_tokens(model, c, n, gen, device):
    """`n` random tokens, each redrawn until every routing decision at its position is
    at least ROUTING_MARGIN from a tie (later tokens cannot change earlier positions),
    so an engine computing in bf16 routes these sequences as HF does."""
    tokens = []
    for _ in range(100 * n):
        if len(tokens) == n:
            break
        cand = torch.randint(0, c.vocab_size, (1,), generator=gen, dtype=torch.int64)
        seq = torch.cat([torch.tensor(tokens, dtype=torch.int64), cand])
        if routing_margins(model, c, seq, device)[-1] >= ROUTING_MARGIN:
            tokens.append(int(cand))
    assert len(tokens) == n, "could not find well-separated routing; lower ROUTING_MARGIN"
    return torch.tensor(tokens, dtype=torch.int64)


def routing_stats(model, c, goldens, device):
    """How many selections the bias changes (vs plain sigmoid top-k), how many the group
    limit changes (vs biased top-k over all experts), and the smallest margin."""
    by_bias = by_group = total = 0
    margin = float("inf")
    k = c.num_experts_per_tok
    for s in range(len(SEQ_LENS)):
        tokens = goldens[f"tokens_{s}"]
        for gate, logits, idx in router_outputs(model, c, tokens, device):
            scores = logits.sigmoid()
            plain = torch.topk(scores, k, dim=-1)[1].sort(-1)[0]
            biased = torch.topk(scores + gate.e_score_correction_bias, k, dim=-1)[1].sort(-1)[0]
            chosen = idx.sort(-1)[0]
            by_bias += int((plain != chosen).any(-1).sum())
            by_group += int((biased != chosen).any(-1).sum())
            total += len(tokens)
        margin = min(margin, routing_margins(model, c, tokens, device).min().item())
    return (
        f"bias changed {by_bias}/{total} selections, group limit {by_group}/{total}, "
        f"smallest routing margin {margin:.2e}"
    )


def save_fixture(dirname, c, stored, goldens, quantized):
    os.makedirs(dirname, exist_ok=True)
    c.save_pretrained(dirname)
    path = os.path.join(dirname, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["dtype"] = "bfloat16"
    if quantized:
        cfg["quantization_config"] = MODELOPT_QUANT
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tensors = {}
    for name, t in stored.items():
        if t.dtype == torch.float32 and t.dim() > 0 and not name.endswith("e_score_correction_bias"):
            t = t.to(torch.bfloat16)
        tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(dirname, "model.safetensors"), metadata={"format": "pt"})
    save_file(goldens, os.path.join(dirname, "golden.safetensors"), metadata={"format": "pt"})


def dump_raw(dirname, weights, goldens):
    os.makedirs(dirname, exist_ok=True)
    with open(os.path.join(dirname, "manifest.txt"), "w") as man:
        for name, t in list(weights.items()) + list(goldens.items()):
            arr = t.to(torch.float32).numpy().astype("<f4")
            arr.tofile(os.path.join(dirname, name + ".f32"))
            man.write(f"{name} {','.join(str(d) for d in t.shape)}\n")


def check_reload(dirname, goldens, device):
    """`from_pretrained` on the written files must reproduce the goldens exactly."""
    model = DeepseekV3ForCausalLM.from_pretrained(
        dirname, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval().to(device)
    for s in range(len(SEQ_LENS)):
        got = logits_of(model, goldens[f"tokens_{s}"], device)
        diff = (got - goldens[f"logits_{s}"]).abs().max().item()
        assert diff == 0.0, f"{dirname}: reloaded logits differ by {diff}"


def verify_quantized_file(dirname, weights):
    """The stored NVFP4 tensors must dequantize to exactly the values the model used."""
    stored = load_file(os.path.join(dirname, "model.safetensors"))
    for name, w in weights.items():
        if ".mlp.experts." not in name:
            assert torch.equal(stored[name].to(torch.float32), w), name
            continue
        p = name[: -len("weight")]
        codes = torch.stack([stored[name] & 15, stored[name] >> 4], -1).reshape(w.shape[0], -1)
        scale = stored[p + "weight_scale"].to(torch.float32).repeat_interleave(16, dim=1)
        deq = e2m1_decode(codes) * scale * stored[p + "weight_scale_2"]
        assert torch.equal(deq, w), name


def generate(name, fields, seed, quantized, args):
    c = make_config(fields)
    weights = random_weights(c, seed)
    stored = weights
    if quantized:
        weights, stored = quantize_experts(c, weights)
    model = build_model(c, weights, args.device)
    gen = torch.Generator().manual_seed(seed + 7)
    goldens, worst = {}, 0.0
    for s, n in enumerate(SEQ_LENS):
        tokens = pick_tokens(model, c, n, gen, args.device)
        goldens[f"tokens_{s}"] = tokens
        goldens[f"logits_{s}"] = logits_of(model, tokens, args.device)
        worst = max(worst, goldens[f"logits_{s}"].abs().max().item())
    routing = routing_stats(model, c, goldens, args.device)
    dirname = os.path.join(args.out, name)
    save_fixture(dirname, c, stored, goldens, quantized)
    if quantized:
        verify_quantized_file(dirname, weights)
    elif args.check:
        check_reload(dirname, goldens, args.device)
    if args.dump_raw:
        dump_raw(os.path.join(args.dump_raw, name), weights, goldens)
    size = sum(os.path.getsize(os.path.join(dirname, f)) for f in os.listdir(dirname))
    std = torch.cat([goldens[f"logits_{s}"].flatten() for s in range(len(SEQ_LENS))]).std().item()
    print(
        f"{name}: {size / 1e6:.2f} MB, logits std {std:.3f} max |.| {worst:.3f}; {routing}"
    )


# ---- goldens of a trained checkpoint ----

# Text a coding agent sends, rendered in Kimi's chat format (as kiln's server renders it).
CHECKPOINT_PROMPTS = (
    "[BOS]<|im_user|>user<|im_middle|>Write a Python function that reverses a list.<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>",
    "[BOS]def binary_search(items, target):\n    lo, hi = 0, len(items)\n    while lo < hi:\n",
)
# The smallest routing margin kept: far above the error of kiln's f32 (`Exact`) model, so
# it routes every golden position as HF does. A sequence stops before the first position
# whose margin is smaller (later tokens never change earlier positions).
CHECKPOINT_MARGIN = 1e-5
CHECKPOINT_TOKENS = 40


def load_checkpoint(dirname):
    """A model directory as kiln ships it -> (config, f32 weights under checkpoint names,
    NVFP4 experts dequantized as `e2m1 * weight_scale * weight_scale_2`)."""
    with open(os.path.join(dirname, "config.json")) as f:
        fields = json.load(f)
    fields.pop("quantization_config", None)
    c = DeepseekV3Config(**fields)
    c._attn_implementation = "eager"
    stored = {}
    for f in sorted(os.listdir(dirname)):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(dirname, f)))
    weights = {}
    for name, t in stored.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            continue
        if t.dtype == torch.uint8:
            p = name[: -len("weight")]
            codes = torch.stack([t & 15, t >> 4], -1).reshape(t.shape[0], -1)
            scale = stored[p + "weight_scale"].to(torch.float32).repeat_interleave(16, dim=1)
            weights[name] = e2m1_decode(codes) * scale * stored[p + "weight_scale_2"]
        else:
            weights[name] = t.to(torch.float32)
    return c, weights


def checkpoint_goldens(dirname, out, device):
    """HF's f32 logits of a trained checkpoint on CHECKPOINT_PROMPTS -> `out`/golden.safetensors."""
    from tokenizers import Tokenizer

    c, weights = load_checkpoint(dirname)
    model = build_model(c, weights, device)
    tok = Tokenizer.from_file(os.path.join(dirname, "tokenizer.json"))
    goldens = {}
    for s, prompt in enumerate(CHECKPOINT_PROMPTS):
        ids = tok.encode(prompt, add_special_tokens=False).ids
        ids = torch.tensor(ids[:CHECKPOINT_TOKENS], dtype=torch.int64)
        margins = routing_margins(model, c, ids, device)
        low = (margins < CHECKPOINT_MARGIN).nonzero()
        keep = int(low[0]) if len(low) else len(ids)
        assert keep >= 8, f"prompt {s}: routing within {CHECKPOINT_MARGIN} of a tie at token {keep}"
        goldens[f"tokens_{s}"] = ids[:keep]
        goldens[f"logits_{s}"] = logits_of(model, ids[:keep], device)
        top = goldens[f"logits_{s}"].argmax(-1)
        print(f"prompt {s}: {keep} of {len(ids)} tokens (smallest routing margin "
              f"{margins[:keep].min().item():.2e}); greedy next tokens {tok.decode(top.tolist())!r}")
    os.makedirs(out, exist_ok=True)
    save_file(goldens, os.path.join(out, "golden.safetensors"), metadata={"format": "pt"})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="fixture root, e.g. tests/fixtures/hf")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="subset of fixtures")
    parser.add_argument("--check", action="store_true", help="reload bf16 fixtures via from_pretrained")
    parser.add_argument("--dump-raw", metavar="DIR", help="also write raw f32 arrays for debugging")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="instead: goldens of this trained model directory into --out")
    args = parser.parse_args()
    # Exact f32 everywhere: no TF32, no reduced-precision reductions, one algorithm.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
    if args.checkpoint:
        return checkpoint_goldens(args.checkpoint, args.out, args.device)
    for name in args.only or FIXTURES:
        generate(name, *FIXTURES[name], args)


if __name__ == "__main__":
    main()
