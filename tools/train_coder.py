#!/usr/bin/env python3
"""Trains kiln's embedded coder model: a small DeepSeek-V3 / Kimi-K2-architecture model
that writes Python, in Kimi's chat format, with NVFP4 routed experts.

One run on the GPU machine (one device call, under 10 minutes), seeded:
1. Corpus: the Python sources on that machine whose licence is permissive (the standard
   library, PSF; installed distributions whose metadata says PSF, BSD, MIT or Apache),
   each file once, in a fixed order. 1 file in 50 (by a hash of its path) is held out.
2. Chat turns generated from the same files, rendered in Kimi's chat format exactly as
   kiln's server renders them (engine/src/server/chat_format.rs): a request and the
   function that answers it (docstring -> code), and an agent turn with a tool call
   (`read_file`), the file as the tool's result and an answer that quotes it.
3. A byte-level BPE tokenizer (`tokenizers`, VOCAB entries) trained on a sample of that
   text, Kimi's special tokens first (ids 0-12, as tools/tiny_tokenizer.py orders them).
4. `DeepseekV3ForCausalLM` (transformers) with kiln's MLA dims (kv_lora_rank 512, rope
   64, nope 128, v 128), first layer dense, MoE with a shared expert and sigmoid gating;
   the routers' correction biases are balanced without an auxiliary loss (DeepSeek-V3:
   each step a bias moves by BIAS_RATE toward equal expert load). AdamW, bf16 autocast,
   warm-up then cosine, for `--steps` (or as many as `--train-seconds` allows at the
   speed of the first steps: the log prints the number, and `--steps N` repeats it).
5. Export to `<out>/model/`: config.json (ModelOpt `quantization_config`), the weights
   under HF checkpoint names, routed experts NVFP4 (tools/hf_golden.py's quantizer,
   bit-exact with reference/src/nvfp4.rs), the rest bf16, in shards under 16 MB with
   `model.safetensors.index.json`; tokenizer.json; `<out>/metrics.json` with the
   held-out loss of the bf16 model and of the model with its experts NVFP4-dequantized;
   `<out>/DATA.md` with the distributions used and their licences; `<out>/held_out.txt`,
   the start of the held-out text, for `kiln perplexity` (not committed).

    python3 tools/train_coder.py --out $OUT/coder [--steps N | --train-seconds S]
    python3 tools/train_coder.py --out /tmp/coder --smoke   # a minute on a CPU: tiny sizes
    python3 tools/train_coder.py --install DIR   # a run's files -> engine/assets/kiln-coder
"""
import argparse
import ast
import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import random
import re
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_golden import KIMI_ROPE, MODELOPT_QUANT, make_config, quantize_experts, weight_shapes  # noqa: E402
from tiny_tokenizer import KIMI_SPECIALS  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402

VOCAB = 8192
SEQ = 2048
BATCH = 16
PEAK_LR = 2e-3
WARMUP = 200
BIAS_RATE = 1e-3
HELD_OUT_ONE_IN = 50
HELD_OUT_SAMPLE = 256 << 10
SHARD_BYTES = 15 << 20
TOKENIZER_SAMPLE = 40 << 20
PERMISSIVE = re.compile(r"\b(PSF|Python Software Foundation|BSD|MIT|Apache)", re.I)

# Kimi's MLA dims; everything else sized so the routed experts are most of the weights
# and the NVFP4 checkpoint stays under ~48 MB.
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=384,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=4 * SEQ,
    rope_parameters=dict(KIMI_ROPE, original_max_position_embeddings=SEQ),
    rope_interleave=True,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=[1, 2],
)
# --smoke: the same code path at sizes a CPU trains in a minute.
SMOKE = dict(MODEL, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64,
             n_routed_experts=8, num_experts_per_tok=2)

BOS, EOS, END, USER, ASSISTANT, SYSTEM, MIDDLE = (KIMI_SPECIALS[i] for i in range(7))
SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END = KIMI_SPECIALS[7:12]
READ_FILE_TOOL = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- corpus ----

def licence_of(dist):
    meta = dist.metadata
    fields = [meta.get("License-Expression") or "", (meta.get("License") or "")[:200]]
    fields += [c for c in meta.get_all("Classifier") or [] if c.startswith("License")]
    text = " ".join(fields)
    m = PERMISSIVE.search(text)
    return (m.group(1) if m else None), text.strip()[:120]


def sources(smoke):
    """[(path, relative name, package, licence)], sorted, permissive only; and the
    packages' licence lines."""
    files, packages = [], {}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(stdlib.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts or "tests" in p.parts:
            continue
        files.append((p, "cpython/" + str(p.relative_to(stdlib)), "cpython-stdlib", "PSF"))
    packages["cpython-stdlib"] = ("PSF", "Python Software Foundation License")
    seen = set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"]
        if not name or name in seen:
            continue
        seen.add(name)
        kind, line = licence_of(dist)
        packages[name] = (kind, line)
        if kind is None:
            continue
        for f in sorted(dist.files or [], key=str):
            if f.suffix == ".py" and "tests" not in f.parts and "test" not in f.parts:
                files.append((Path(dist.locate_file(f)), f"{name}/{f}", name, kind))
    if smoke:
        files = files[::40]
    return files, packages


def held_out(rel):
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELD_OUT_ONE_IN == 0


def render(messages, tools=None):
    """Kimi's chat format as text, as kiln's `KimiFormat::render` lays out its ids (no
    [BOS]: the server renders none; the shipped kiln-coder was trained with one in front)."""
    out = []
    if tools:
        out.append(f"{SYSTEM}tool_declare{MIDDLE}{json.dumps(tools, separators=(',', ':'))}{END}")
    for m in messages:
        role = m["role"]
        if role == "tool":
            out.append(f"{SYSTEM}tool{MIDDLE}## Return of {m['tool_call_id']}\n")
        else:
            out.append({"user": USER, "assistant": ASSISTANT, "system": SYSTEM}[role] + role + MIDDLE)
        out.append(m.get("content") or "")
        if m.get("tool_calls"):
            out.append(SECTION_BEGIN)
            for c in m["tool_calls"]:
                out.append(f"{CALL_BEGIN}{c['id']}{ARG_BEGIN}{c['arguments']}{CALL_END}")
            out.append(SECTION_END)
        out.append(END)
    return "".join(out)


def chats_of(rel, text, rng):
    """Chat turns from one file's documented functions."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("__") or not hasattr(node, "end_lineno"):
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if not 10 <= len(summary) <= 300:
            continue
        code = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if len(code) > 3000:
            continue
        signature = code.split("\n", 1)[0].strip().removesuffix(":")
        request = rng.choice([
            f"Write a Python function `{node.name}`: {summary}",
            f"Implement `{signature.removeprefix('def ').removeprefix('async def ')}` in Python. {summary}",
            f"I need a function that does this: {summary} Call it `{node.name}`.",
        ])
        out.append(render([
            {"role": "user", "content": request},
            {"role": "assistant", "content": f"```python\n{code}\n```"},
        ]))
        if rng.random() < 0.3 and len(text) < 12000:
            call = "functions.read_file:0"
            out.append(render([
                {"role": "system", "content": "You are a coding agent. Read files before you answer."},
                {"role": "user", "content": f"What does `{node.name}` in `{rel}` do?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": call, "arguments": json.dumps({"path": rel})}]},
                {"role": "tool", "tool_call_id": call, "content": text},
                {"role": "assistant", "content":
                    f"`{node.name}` in `{rel}`: {summary}\n\n```python\n{code}\n```"},
            ], READ_FILE_TOOL))
    return out


def documents(item):
    """(held out?, [texts]) of one source file: the file itself and its chats."""
    path, rel, _, _ = item
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False, []
    if not text.strip() or len(text) > 200_000:
        return False, []
    rng = random.Random(rel)
    return held_out(rel), [BOS + text + EOS] + chats_of(rel, text, rng)


# ---- tokenizer ----

def train_tokenizer(texts, smoke):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024 if smoke else VOCAB,
        special_tokens=KIMI_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert all(tok.token_to_id(s) == i for i, s in enumerate(KIMI_SPECIALS))
    return tok


# ---- model ----

def moe_layers(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def count_loads(model, counts):
    """Hooks that add each routed expert's tokens to `counts[layer]`."""
    def hook(i):
        def pre(_module, args, kwargs):
            given = list(args) + list(kwargs.values())
            index = next(a for a in given if torch.is_tensor(a) and not a.is_floating_point())
            counts[i] += torch.bincount(index.flatten(), minlength=counts[i].numel())[: counts[i].numel()]
        return pre
    layers = enumerate(moe_layers(model))
    return [m.experts.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in layers]


def checkpoint_weights(c, model):
    """The trained module's weights under checkpoint names (experts one by one), f32."""
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {}
    for name in weight_shapes(c):
        if ".mlp.experts." in name:
            parts = name.split(".")
            layer, j, proj = parts[2], int(parts[5]), parts[6]
            p = f"model.layers.{layer}.mlp.experts."
            inter = c.moe_intermediate_size
            if proj == "down_proj":
                out[name] = sd[p + "down_proj"][j]
            else:
                gu = sd[p + "gate_up_proj"][j]
                out[name] = gu[:inter] if proj == "gate_proj" else gu[inter:]
        else:
            out[name] = sd[name]
    return out


@torch.no_grad()
def held_out_loss(model, blocks, device):
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(blocks), BATCH):
        x = blocks[i:i + BATCH].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total, n = total + loss.item(), n + x[:, 1:].numel()
    model.train()
    return total / n


def blocks_of(ids, seq):
    n = len(ids) // (seq + 1)
    return torch.from_numpy(ids[: n * (seq + 1)].astype(np.int64)).reshape(n, seq + 1)


def encode(tok, texts):
    """All texts' ids, one after another, as int32."""
    parts = [np.zeros(0, dtype=np.int32)]
    for i in range(0, len(texts), 2048):
        parts += [np.asarray(e.ids, dtype=np.int32)
                  for e in tok.encode_batch(texts[i:i + 2048], add_special_tokens=False)]
    return np.concatenate(parts)


def save_checkpoint(model_dir, c, stored, tok):
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = c.to_dict()
    for k in ("_attn_implementation_autoset", "attn_implementation", "experts_implementation",
              "_experts_implementation", "transformers_version", "torch_dtype"):
        cfg.pop(k, None)
    cfg.update(architectures=["DeepseekV3ForCausalLM"], dtype="bfloat16",
               quantization_config=MODELOPT_QUANT)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save(str(model_dir / "tokenizer.json"))
    write_tokenizer_config(model_dir)
    tensors = {}
    for name, t in stored.items():
        if t.dtype == torch.float32 and t.dim() > 0 and not name.endswith("e_score_correction_bias"):
            t = t.to(torch.bfloat16)
        tensors[name] = t.contiguous()
    shards, size = [[]], 0
    for name in sorted(tensors):
        b = tensors[name].numel() * tensors[name].element_size()
        if size + b > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


KIMI_TEMPLATE = Path(__file__).resolve().parent.parent / "engine" / "src" / "server" / "kimi_chat.jinja"


def write_tokenizer_config(model_dir):
    """tokenizer_config.json as checkpoints ship it: the chat template kiln serves the model
    with (Kimi's format, as `render` writes the training chats; the server adds no [BOS])
    and the special tokens templates name."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": END,
           "chat_template": KIMI_TEMPLATE.read_text()}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def install(src):
    """Merges a run's shards (as they come back from the GPU machine, each under 16 MB) into
    one model.safetensors under engine/assets/kiln-coder/, beside its config, tokenizer,
    metrics and DATA.md: the files kiln embeds."""
    from safetensors.torch import load_file
    dst = Path(__file__).resolve().parent.parent / "engine" / "assets" / "kiln-coder"
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.rglob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
    index = json.loads(next(src.rglob("model.safetensors.index.json")).read_text())
    assert set(tensors) == set(index["weight_map"]), "shards missing"
    save_file(dict(sorted(tensors.items())), str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "metrics.json", "DATA.md"):
        (dst / name).write_bytes(next(src.rglob(name)).read_bytes())
    write_tokenizer_config(dst)
    log(f"installed {len(tensors)} tensors into {dst}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", type=Path, metavar="DIR",
                    help="install a finished run's files (DIR) as kiln's embedded model, and stop")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, help="optimizer steps (default: what --train-seconds allows)")
    ap.add_argument("--train-seconds", type=float, default=330.0)
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds from start by which the run must have written its files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and a sample of the files")
    args = ap.parse_args()
    if args.install:
        return install(args.install)
    if not args.out:
        ap.error("--out is required")
    started = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)

    files, packages = sources(args.smoke)
    with multiprocessing.Pool(min(16, os.cpu_count() or 1)) as pool:
        docs = pool.map(documents, files, chunksize=64)
    train_texts = [t for held, ts in docs if not held for t in ts]
    test_texts = [t for held, ts in docs if held for t in ts]
    rng = random.Random(args.seed)
    rng.shuffle(train_texts)
    used = {}
    for (_, _, pkg, kind), (_, ts) in zip(files, docs):
        if ts:
            used.setdefault(pkg, [kind, 0])[1] += len(ts[0])
    n_chats = sum(max(0, len(ts) - 1) for _, ts in docs)
    log(f"{len(files)} files from {len(used)} packages, {sum(len(t) for t in train_texts) / 1e6:.0f} MB "
        f"of training text ({n_chats} chat turns), {len(test_texts)} held-out texts")

    sample, size = [], 0
    for t in train_texts:
        if size > TOKENIZER_SAMPLE:
            break
        sample.append(t)
        size += len(t)
    tok = train_tokenizer(sample, args.smoke)
    log(f"tokenizer: {tok.get_vocab_size()} tokens, trained on {size / 1e6:.0f} MB")
    train_ids, test_ids = encode(tok, train_texts), encode(tok, test_texts)
    log(f"{len(train_ids) / 1e6:.1f}M training tokens, {len(test_ids) / 1e6:.2f}M held out")

    fields = dict(SMOKE if args.smoke else MODEL, vocab_size=tok.get_vocab_size())
    seq = 256 if args.smoke else SEQ
    c = make_config(fields)
    c._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(c).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    log(f"model: {params / 1e6:.1f}M parameters, {100 * experts / params:.0f}% routed experts")

    train, test = blocks_of(train_ids, seq), blocks_of(test_ids, seq)[: 64 if args.smoke else 256]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95), fused=device.type == "cuda")
    counts = [torch.zeros(c.n_routed_experts, device=device, dtype=torch.long) for _ in moe_layers(model)]
    hooks = count_loads(model, counts)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    steps, step, t0 = args.steps, 0, time.time()
    while steps is None or step < steps:
        # Calibrated on steps 20-60: the first ones run while kernels compile and caches warm.
        if steps is None and step == 20:
            t20 = time.time()
        if steps is None and step == 60:
            per_step = (time.time() - t20) / 40
            now = time.time()
            left = min(args.train_seconds - (now - t0), args.deadline - (now - started) - 45)
            steps = max(step + 1, step + int(left / per_step))
            log(f"{per_step * 1000:.0f} ms a step ({BATCH * seq / per_step / 1e3:.0f}k tokens/s): "
                f"{steps} steps (repeat with --steps {steps})")
        # Linear warm-up, then cosine over the rest: calibration ends inside the warm-up, so
        # a run with --steps N repeats a calibrated run of N steps exactly.
        if step < WARMUP:
            lr = PEAK_LR * (step + 1) / WARMUP
        else:
            done = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
            lr = PEAK_LR * 0.5 * (1 + math.cos(math.pi * done))
        for g in opt.param_groups:
            g["lr"] = max(lr, PEAK_LR * 0.02)
        idx = order[(step * BATCH) % len(order):][:BATCH]
        if len(idx) < BATCH:
            idx = order[:BATCH]
        x = train[idx].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for mlp, load in zip(moe_layers(model), counts):
                bias = mlp.gate.e_score_correction_bias
                bias += BIAS_RATE * torch.sign(load.float().mean() - load.float())
                load.zero_()
        if step % 100 == 0:
            log(f"step {step}: loss {loss.item():.3f}, lr {lr:.2e}, {time.time() - started:.0f} s")
        step += 1
    for h in hooks:
        h.remove()
    train_seconds = time.time() - t0

    bf16_loss = held_out_loss(model, test, device)
    weights = checkpoint_weights(c, model)
    weights = {k: v.to(torch.bfloat16).float() if not k.endswith("e_score_correction_bias") else v
               for k, v in weights.items()}
    deq, stored = quantize_experts(c, weights)
    sd = model.state_dict()
    for i in range(c.first_k_dense_replace, c.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        for j in range(c.n_routed_experts):
            g, u, d = (deq[p + f"{j}.{m}_proj.weight"] for m in ("gate", "up", "down"))
            sd[p + "gate_up_proj"][j].copy_(torch.cat([g, u]))
            sd[p + "down_proj"][j].copy_(d)
    nvfp4_loss = held_out_loss(model, test, device)
    size = save_checkpoint(args.out / "model", c, stored, tok)
    metrics = {
        "parameters": params, "routed_expert_parameters": experts, "steps": steps, "seq": seq,
        "batch": BATCH, "train_tokens_seen": steps * BATCH * seq, "train_seconds": round(train_seconds, 1),
        "corpus_tokens": len(train_ids), "held_out_tokens": int(test[:, 1:].numel()),
        "held_out_loss_bf16": bf16_loss, "held_out_ppl_bf16": math.exp(bf16_loss),
        "held_out_loss_nvfp4_experts": nvfp4_loss, "held_out_ppl_nvfp4_experts": math.exp(nvfp4_loss),
        "checkpoint_bytes": size, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "seed": args.seed,
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    # The held-out text (its first HELD_OUT_SAMPLE characters), for `kiln perplexity`.
    (args.out / "held_out.txt").write_text("".join(test_texts)[:HELD_OUT_SAMPLE])
    rows = "\n".join(f"| {pkg} | {kind} | {chars / 1e6:.2f} |" for pkg, (kind, chars) in sorted(used.items()))
    (args.out / "DATA.md").write_text(
        "# Training data of kiln's embedded coder model\n\n"
        "Python sources found on the GPU machine, one copy of each file, kept where the "
        "distribution's metadata names a permissive licence (the regular expression "
        f"`{PERMISSIVE.pattern}`), plus chat turns generated from them by tools/train_coder.py. "
        "The corpus itself is not committed.\n\n| distribution | licence | MB of source |\n|---|---|---|\n"
        + rows + "\n")
    log(f"held-out perplexity bf16 {math.exp(bf16_loss):.2f}, NVFP4 experts {math.exp(nvfp4_loss):.2f}; "
        f"checkpoint {size / 1e6:.1f} MB; {time.time() - started:.0f} s in all")


if __name__ == "__main__":
    main()
