#!/usr/bin/env python3
"""Writes the reference outputs the tests check orcd against, for one GGUF model.

Hugging Face transformers loads the GGUF itself (dequantized to fp32) and runs in fp32:
  - tokenizer: the ids of tricky strings;
  - prompts: greedy generation from each prompt, then the same sequence teacher-forced, keeping
    the top-5 logits at every generated position (position i: the logits that predicted gen[i]).

Run it where torch, transformers and gguf are installed (a GPU makes it quick; the CPU works):
  python3 tests/refs/make_refs.py --gguf MODEL.gguf --out tests/refs/NAME.hf.json
The tests pick the file of their folder ($ORCD_REFS, else tests/refs/) whose model.bytes is the
size of the model under test.
"""
import argparse
import hashlib
import json
import os

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

TOKENIZER_TEXTS = [
    "Hello, world!",
    "  leading spaces and   runs\tof\twhitespace\n\n",
    "naïve café — déjà vu",
    "日本語のテキストと中文",
    "emoji 🚀🔥👩\u200d💻 mix",
    'fn main() { println!("{}", 42_000usize); }',
    "3.14159 1e-6 100000000 0x1F",
    "<|im_start|>user\nhi<|im_end|>",
    "don't won't they're I'M",
    "x" * 50,
    "\xa0non-breaking\u200bzero-width",
    "Ελληνικά и русский",
]

# (kind, text, tokens to generate at most): chat prompts go through the model's chat template.
PROMPTS = [
    ("chat", "Write a haiku about GPU computing. It must contain the word 'seventeen'.", 64),
    ("raw", "The capital of France is", 64),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the model file")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args()

    folder, name = os.path.split(os.path.abspath(args.gguf))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = model.to(device).eval()

    out = {
        "about": (
            f"Reference outputs of Hugging Face transformers {transformers.__version__} "
            f"(torch {torch.__version__}, fp32, {device.upper()}) for {name}. Greedy decoding; "
            "top5_ids/top5_vals are teacher-forced logits at each generated position "
            "(position i = the logits that predicted gen[i])."
        ),
        "model": {"file": name, "bytes": os.path.getsize(args.gguf), "sha256": sha256(args.gguf)},
        "tokenizer": [
            {"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TOKENIZER_TEXTS
        ],
        "prompts": [],
    }
    for kind, text, max_new in PROMPTS:
        if kind == "chat":
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok.encode(text, add_special_tokens=False)
        ids = list(map(int, ids))
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=max_new,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                repetition_penalty=1.0,
            )[0].tolist()
            gen = seq[len(ids):]
            logits = model(torch.tensor([ids + gen], device=device)).logits[0]
        rows = logits[len(ids) - 1 : len(ids) - 1 + len(gen)].float()
        vals, top = rows.topk(5, dim=-1)
        out["prompts"].append(
            {
                "kind": kind,
                "text": text,
                "ids": ids,
                "gen": gen,
                "gen_text": tok.decode(gen, skip_special_tokens=False),
                "top5_ids": top.tolist(),
                "top5_vals": [[round(v, 4) for v in r] for r in vals.tolist()],
            }
        )
    with open(args.out, "w") as f:
        json.dump(out, f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
