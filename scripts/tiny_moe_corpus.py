"""The corpus of the bundled tiny model (``train_tiny_moe.py``), also the draft's
(``train_draft.py``: the same documents and held-out split).

Owns: splitting local corpus files into documents and a held-out tail, the byte-level BPE
tokenizer trained on the training split (eos ``EOS``, the chat template), each domain's
token streams (``Domain``), and the seeded interleaving of training chunks across domains. A
helper module of the scripts, not part of the library; it never downloads anything.

Dimension letters: N chunks, T tokens per chunk.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}System: {{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

@dataclass
class Domain:
    """One corpus file: its documents split into train and held-out token streams."""
    name: str
    path: str
    train_docs: int
    heldout_docs: int
    train_ids: list[int] = field(default_factory=list, repr=False)
    heldout_ids: list[int] = field(default_factory=list, repr=False)


def read_documents(path: str) -> list[str]:
    """Split one corpus file into documents, in file order.

    .jsonl with question/answer -> one "Question: ...\\nAnswer: ..." document per line;
    wikitext (" = Title = " headings) -> one document per article; anything else -> blocks of
    about 40 lines (keeps plays and prose contiguous inside a block).
    """
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
    lines = text.splitlines(keepends=True)
    if any(re.match(r"^ = [^=].* = \s*$", line) for line in lines[:50]):
        docs, cur = [], []
        for line in lines:
            if re.match(r"^ = [^=].* = \s*$", line) and cur:
                docs.append("".join(cur).strip() + "\n")
                cur = []
            cur.append(line)
        docs.append("".join(cur).strip() + "\n")
        return [d for d in docs if d.strip()]
    return ["".join(lines[i:i + 40]) for i in range(0, len(lines), 40)]


def split_documents(docs: list[str], heldout_frac: float) -> tuple[list[str], list[str]]:
    """Hold out the last `heldout_frac` of a file's characters (whole documents, at least one)."""
    total = sum(len(d) for d in docs)
    cut, tail = len(docs), 0
    while cut > 1 and (tail < heldout_frac * total or cut == len(docs)):
        cut -= 1
        tail += len(docs[cut])
    return docs[:cut], docs[cut:]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over the training split only; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tokenizer, docs: list[str]) -> list[int]:
    """Concatenate documents into one token stream, each followed by eos."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return ids


def load_domains(paths: list[str], heldout_frac: float, vocab_size: int):
    """(tokenizer, one ``Domain`` per file): the tokenizer trained on every training split."""
    docs = {p: split_documents(read_documents(p), heldout_frac) for p in paths}
    tokenizer = train_tokenizer([d for tr, _ in docs.values() for d in tr], vocab_size)
    domains = []
    for p, (train, held) in docs.items():
        d = Domain(Path(p).stem, p, len(train), len(held))
        d.train_ids, d.heldout_ids = encode_stream(tokenizer, train), encode_stream(tokenizer, held)
        domains.append(d)
    return tokenizer, domains


def chunk(ids: list[int], seq_len: int) -> torch.Tensor:
    """[N, T] non-overlapping full chunks of a stream (a final partial chunk is dropped)."""
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def mixed_order(domains: list[Domain], seq_len: int, epoch: int, seed: int) -> torch.Tensor:
    """[N, T] chunks of every domain, interleaved by a seeded shuffle (deterministic per epoch)."""
    chunks = torch.cat([chunk(d.train_ids, seq_len) for d in domains])
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return chunks[torch.randperm(len(chunks), generator=g)]
