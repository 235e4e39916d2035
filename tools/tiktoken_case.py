"""A Kimi-format tiktoken tokenizer and its own encodings, for kiln's tokenizer tests.

Writes into the directory argv[1]:
- tiktoken.model: BPE ranks trained by the `tiktoken` package (its reference trainer,
  `tiktoken._educational.bpe_train`) on this repository's README and sources plus a Chinese
  and a mixed-script paragraph, split by Kimi's pattern;
- tokenizer_config.json: Kimi's `added_tokens_decoder` layout (special ids start right
  after the ranks) for a few named tokens;
- cases.json: texts and the ids `tiktoken.Encoding` gives them with that pattern and those
  special tokens (plain text, and text with special tokens allowed).

    python3 tools/tiktoken_case.py DIR [VOCAB]
"""
import base64
import json
import pathlib
import sys

import tiktoken
from tiktoken._educational import bpe_train

# Kimi K2's `pat_str` (tokenization_kimi.py).
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# The trainer splits with Python's `regex`, which reads `&&` literally: it trains on this
# simpler split (the ranks are only data; encoding uses Kimi's pattern).
TRAIN_PATTERN = r"""[\p{Han}]+| ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
RESERVED = 256
NAMED = {0: "[BOS]", 1: "[EOS]", 4: "<|im_user|>", 5: "<|im_assistant|>", 7: "<|im_end|>"}

HAN = "推理引擎为编程智能体服务。前缀缓存命中率应该达到百分之九十九。解码速度第一，然后是吞吐量。"
MIXED = "kiln 的 MoE 内核用 CubeCL 写成：NVFP4 GEMM、MLA 注意力、树验证。Don't stop; it'll be fine—we've 12345 tokens."


def training_text(root):
    parts = [(root / "README.md").read_text()]
    for path in sorted((root / "engine" / "src" / "scheduler").glob("*.rs"))[:3]:
        parts.append(path.read_text())
    parts += [HAN * 20, MIXED * 20]
    return "\n".join(parts)


def main():
    out = pathlib.Path(sys.argv[1])
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 700
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(__file__).resolve().parent.parent
    ranks = bpe_train(training_text(root)[:60_000], vocab, TRAIN_PATTERN, visualise=None)
    # The format tiktoken's `load_tiktoken_bpe` reads: base64 token, space, rank.
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    specials = {NAMED.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(RESERVED)}
    config = {
        "added_tokens_decoder": {
            str(base + i): {"content": name, "special": True} for i, name in NAMED.items()
        }
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    enc = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    texts = [
        "Hello world",
        "def reverse(xs):\n    return xs[::-1]\n\n\n",
        "  leading spaces\tand tabs\r\nCRLF lines\n",
        HAN,
        MIXED,
        "I'M SHOUTING, you're not; THEY'LL see. CamelCaseWordsHere and snake_case_words",
        "数字 3.14159 和 1000000 以及 émigré naïve café Ελληνικά русский",
        "🙂 emoji and \u200b zero width and \x00 nul",
    ]
    chats = [
        "[BOS]<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>",
        "text <|im_end|> between <|reserved_token_%d|> specials[EOS]" % (base + 100),
    ]
    cases = [{"text": t, "special": False, "ids": enc.encode(t, disallowed_special=())} for t in texts]
    cases += [{"text": t, "special": True, "ids": enc.encode(t, allowed_special="all")} for t in chats]
    (out / "cases.json").write_text(json.dumps({"ranks": base, "cases": cases}, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
