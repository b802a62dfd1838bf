"""Build the embedded default: the tiny chat dataset, its BPE tokenizer and the tiny model config.

Run once; its outputs are committed, and running it again reproduces them byte for byte
(fixed seed). It writes:
  data/tiny/train.jsonl, data/tiny/validation.jsonl   chat records in `messages` format
  configs/tiny_model/                                  config.json, tokenizer files, chat template

The tasks are letter puzzles a few-million-parameter model learns in minutes on a CPU:
reverse, upper-case or sort a short sequence of letters, and name the letter that follows one.

With --preference it writes the preference pairs of the DPO default instead, from the files above:
  data/tiny_pref/train.jsonl, data/tiny_pref/validation.jsonl   prompt/chosen/rejected, conversational

Usage: python scripts/build_tiny_default.py [--out-dir .] [--preference]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from sft_play.tiny_puzzles import ANSWERS, puzzle, repeating_letters, task

SEED = 1234
N_TRAIN = 6000  # the first training records, and the ones the tokenizer is trained on
N_VALIDATION = 200
# More training records, drawn after the validation ones (so the first 6200 records, the
# tokenizer and the validation set are those of the 6000-record dataset): a run of the default
# sees most rows once, and learns the puzzles instead of the rows (199 of 200 held-out answers
# instead of 192 for the same steps; docs in configs/run_tiny.yaml)
N_MORE_TRAIN = 18000
# What a small model gets wrong is letters that repeat (`Uppercase the letters: m y n m` answered
# `M Y M N`, `Sort the letters: c f x a a b` losing an `a`): in the later records, half the reverse,
# uppercase and sort questions are redrawn with letters that repeat, each task keeping its share.
# bench/tiny_recipes.py measured it (recipe "repeats" against the default before it; docs/reports/tiny_recipes.md).
REPEAT_SHARE = 0.5
REPEAT_SEED = 7
VOCAB_SIZE = 512  # a multiple of 32 keeps bitsandbytes' 4-bit CPU kernels happy
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML with {% generation %} markers around what the assistant says, so that the tokenizer
# can return the assistant-token mask that loss-on-answers-only needs.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    # Narrow and four layers deep: the puzzles need depth (two layers of 256 answered 105 of 200
    # held-out puzzles where four answered 169) more than width (128 wide learns as well as 256 per
    # step, at half the step time, so it gets twice the steps in the same minutes)
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    # Wider than Llama's 0.02 so that a frozen random output head can still express confident
    # predictions: LoRA trains neither the head nor the final norm.
    "initializer_range": 0.06,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "use_cache": True,
    "dtype": "float32",
}

def drill_repeats(records: list[dict], share: float = REPEAT_SHARE, seed: int = REPEAT_SEED) -> list[dict]:
    """`records` with `share` of their reverse, uppercase and sort questions redrawn (in place) with
    letters that repeat, the answers to match."""
    rng = random.Random(seed)
    for record in records:
        messages = record["messages"]
        for i, message in enumerate(messages[:-1]):
            kind = message["content"].split()[0]
            if message["role"] != "user" or kind not in ANSWERS or rng.random() >= share:
                continue
            question, answer = puzzle(kind, repeating_letters(rng))
            messages[i], messages[i + 1] = {"role": "user", "content": question}, {"role": "assistant", "content": answer}
    return records


def make_record(rng: random.Random) -> dict:
    """A conversation of one or (one time in five) two question-answer turns."""
    messages = []
    if rng.random() < 0.1:
        messages.append({"role": "system", "content": "You solve letter puzzles."})
    for _ in range(2 if rng.random() < 0.2 else 1):
        question, answer = task(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def build_dataset(out_dir: Path) -> list[dict]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    records: list[dict] = []
    while len(records) < N_TRAIN + N_VALIDATION + N_MORE_TRAIN:
        record = make_record(rng)
        key = json.dumps(record, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        records.append(record)
    data_dir = out_dir / "data" / "tiny"
    data_dir.mkdir(parents=True, exist_ok=True)
    train = records[:N_TRAIN] + drill_repeats(records[N_TRAIN + N_VALIDATION:])
    for name, rows in (("train", train), ("validation", records[N_TRAIN:N_TRAIN + N_VALIDATION])):
        with open(data_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return records


def build_tokenizer(records: list[dict], model_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [m["content"] for r in records for m in r["messages"]] + ["user", "assistant", "system"]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(model_dir)
    vocab = fast.get_vocab()
    assert vocab["<|endoftext|>"] == MODEL_CONFIG["pad_token_id"] and vocab["<|im_end|>"] == MODEL_CONFIG["eos_token_id"]


PREFERENCE_TRAIN = 4000  # pairs from the first single-turn records of data/tiny/train.jsonl


def preference_pairs(records: list[dict], limit: int | None = None) -> list[dict]:
    """The DPO default's preference, learned on top of the SFT model: answers in upper case.
    From each single-turn Reverse, Sort and Which record: chosen is the correct answer in upper
    case, rejected the correct answer as the SFT model learned it (lower case). The two sides
    differ only in case, token for token, so the preference cannot be won by length. Uppercase
    puzzles are left out (their answer is upper case already)."""
    pairs = []
    for record in records:
        turns = record["messages"]
        if len(turns) != 2 or turns[0]["content"].startswith("Uppercase"):
            continue
        answer = turns[1]["content"]
        pairs.append({"prompt": [turns[0]], "chosen": [{"role": "assistant", "content": answer.upper()}],
                      "rejected": [{"role": "assistant", "content": answer}]})
        if len(pairs) == limit:
            break
    return pairs


def build_preference(out_dir: Path) -> None:
    source, target = out_dir / "data" / "tiny", out_dir / "data" / "tiny_pref"
    target.mkdir(parents=True, exist_ok=True)
    for name, limit in (("train", PREFERENCE_TRAIN), ("validation", None)):
        with open(source / f"{name}.jsonl", encoding="utf-8") as f:
            pairs = preference_pairs([json.loads(line) for line in f], limit)
        with open(target / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for pair in pairs:
                f.write(json.dumps(pair) + "\n")
        print(f"wrote {len(pairs)} pairs to {target / name}.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=".", help="repository root to write into")
    parser.add_argument("--preference", action="store_true", help="write data/tiny_pref from data/tiny")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    if args.preference:
        build_preference(out_dir)
        return
    records = build_dataset(out_dir)
    model_dir = out_dir / "configs" / "tiny_model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    build_tokenizer(records[:N_TRAIN], model_dir)
    print(f"wrote {N_TRAIN + N_MORE_TRAIN} + {N_VALIDATION} records to {out_dir / 'data/tiny'} and the model to {model_dir}")


if __name__ == "__main__":
    main()
